"""Progress reporting without a UI dependency: the library calls a Progress, the CLI backs it
with tqdm. Thread-safe, since executors advance it from worker threads."""
from __future__ import annotations

import threading
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


class LockedProgress:
    """Wraps a Progress so worker threads may advance it concurrently."""

    def __init__(self, inner: Progress) -> None:
        self._inner = inner
        self._lock = threading.Lock()

    def start(self, total: int, desc: str) -> None:
        with self._lock:
            self._inner.start(total, desc)

    def advance(self, n: int) -> None:
        with self._lock:
            self._inner.advance(n)

    def close(self) -> None:
        with self._lock:
            self._inner.close()
