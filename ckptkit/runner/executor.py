"""Run independent write jobs (one per output file) on threads, sharing a memory budget.

Each job streams its own file sequentially; jobs run in parallel because reads and tensor
copies release the GIL. The first failure cancels the rest and is re-raised unchanged.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")


def run_jobs(jobs: Sequence[Callable[[], T]], workers: int) -> list[T]:
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
