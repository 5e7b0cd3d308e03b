"""Run independent write jobs (one per output file) on threads, sharing a memory budget.

Each job streams its own file sequentially; jobs run in parallel because reads and tensor
copies release the GIL. The first failure cancels the rest and is re-raised unchanged.
In a distributed job (runner/distributed.py) each rank runs its share of the jobs, dealt out by
`weights` (bytes), and every rank gets every job's result back in order.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .distributed import Group

T = TypeVar("T")


def _run_local(jobs: Sequence[Callable[[], T]], workers: int) -> list[T]:
    if workers <= 1 or len(jobs) <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        futures = [pool.submit(job) for job in jobs]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


def run_jobs(jobs: Sequence[Callable[[], T]], workers: int, *, group: "Group | None" = None,
             weights: Sequence[int] | None = None) -> list[T]:
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
