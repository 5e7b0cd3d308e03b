"""Progress reporting without a UI dependency: the library calls a Progress, the CLI backs it
with tqdm. Thread-safe, since executors advance it from worker threads."""
from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, total: int, desc: str) -> None: ...
    def advance(self, n: int) -> None: ...
    def close(self) -> None: ...


class NullProgress:
    def start(self, total: int, desc: str) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
