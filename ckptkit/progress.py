"""Progress reporting without a UI dependency: the library calls a Progress, the CLI backs it
with tqdm. Thread-safe, since executors advance it from worker threads."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, total: int, desc: str) -> None: ...
    def advance(self, n: int) -> None: ...
    def close(self) -> None: ...
    def retotal(self, total: int) -> None: ...


class NullProgress:
    def start(self, total: int, desc: str) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass

    def retotal(self, total: int) -> None:
        pass


def retotal(progress: Progress, total: int) -> None:
    """The phase begun by the last start() moves `total` bytes after all: a writer that lays out
    exactly what it writes (per-rank copies, padding) corrects the estimate its operation started
    with, so the count ends at 100%. A Progress of the caller's own without retotal keeps its total."""
    fix = getattr(progress, "retotal", None)
    if fix is not None:
        fix(total)
