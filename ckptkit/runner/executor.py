"""Run independent write jobs (one per output file) on threads, sharing a memory budget.

Each job streams its own file sequentially; jobs run in parallel because reads and tensor
copies release the GIL. The first failure stops the rest (at their next interrupts.check()) and
is re-raised unchanged; so does a Ctrl-C.
In a distributed job (runner/distributed.py) each rank runs its share of the jobs, dealt out by
`weights` (bytes), and every rank gets every job's result back in order.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, TypeVar

from .. import interrupts

if TYPE_CHECKING:
    from .distributed import Group

T = TypeVar("T")
POLL_S = 0.1  # how often the waiting main thread looks for a Ctrl-C (a signal may wake another thread)


def _worker_start() -> None:
    """Workers block SIGINT, so the kernel hands Ctrl-C to the main thread, which handles it."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _run_local(jobs: Sequence[Callable[[], T]], workers: int) -> list[T]:
    if workers <= 1 or len(jobs) <= 1:
        results = []
        for job in jobs:
            interrupts.check()
            results.append(job())
        return results
    stop = threading.Event()  # the run is over: running jobs stop at their next check
    pool = ThreadPoolExecutor(max_workers=min(workers, len(jobs)), initializer=_worker_start)
    try:
        futures = [pool.submit(interrupts.stoppable(stop, job)) for job in jobs]
        pending: set[Future] = set(futures)
        while pending:
            interrupts.check()
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_EXCEPTION)
            if any(f.exception() is not None for f in done):
                break
        error = _first_error(futures)
        if error is not None:
            raise error
        return [f.result() for f in futures]
    finally:  # runs to the end on any exit: no job outlives the run (a Ctrl-C only sets a flag)
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


def _first_error(futures: list[Future]) -> BaseException | None:
    """The failure to report: the first job's own error, not a sibling's Stopped."""
    errors = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
    real = [e for e in errors if not isinstance(e, interrupts.Stopped)]
    return (real or errors or [None])[0]


def run_jobs(
    jobs: Sequence[Callable[[], T]], workers: int, *, group: "Group | None" = None, weights: Sequence[int] | None = None
) -> list[T]:
    if group is None or not group.distributed:
        return _run_local(jobs, workers)
    mine = group.assign(list(weights) if weights is not None else [1] * len(jobs))
    error: BaseException | None = None
    results: list[T] = []
    try:
        results = _run_local([jobs[i] for i in mine], workers)
    except BaseException as exc:  # reported to every rank below
        error = exc
    group.check(error)
    merged: dict[int, T] = {}
    for pairs in group.gather_all(list(zip(mine, results))):
        merged.update(pairs)
    return [merged[i] for i in range(len(jobs))]
