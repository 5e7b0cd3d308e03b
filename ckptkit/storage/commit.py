"""The output commit protocol: what every output is, whichever way it commits.

An output appears complete, or not at all. It is begun (`__enter__`: checks, lock, a temporary
location), written file by file (`open`, `write_bytes`), then committed when its `with` block
ends cleanly and every rank succeeded, or abandoned otherwise. Two implementations exist, chosen
by one factory (storage/output.py `open_output`): `RenameOutput` (storage/rename_output.py: a
local temporary sibling renamed into place) and `MarkerOutput` (storage/remote_output.py: object
stores, where a marker written last is the commit). This module holds what both share and
imports neither of them.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, BinaryIO, Callable, Protocol

if TYPE_CHECKING:
    from ..runner.distributed import Group


class Output(Protocol):
    """What a writer sees of an output: files by path relative to OUT, and the ranks writing it.
    Every rank writes its own files with `open`; `write_bytes` (small files) writes on rank 0 only."""

    group: Group

    def open(self, rel: str) -> BinaryIO: ...
    def write_bytes(self, rel: str, data: bytes) -> None: ...


class OutputCommit(Output, Protocol):
    """An output being built at `path`: `with` begins it, a clean exit commits it, an error (on
    any rank) aborts it. `commit` and `abort` are the two ends `__exit__` chooses between."""

    path: str

    def __enter__(self) -> OutputCommit: ...
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


def on_root(group: Group, fn: Callable[[], object]) -> None:
    """Run `fn` on rank 0 (the only rank of a one-process run); every rank hears if it failed."""
    error: BaseException | None = None
    if group.is_root:
        try:
            fn()
        except BaseException as exc:  # every rank must hear of it
            error = exc
    group.check(error)


class FinishingFile:
    """An open binary file (a proxy: zipfile and friends see a file) that finishes an output's
    work when closed: `_finish(ok)` runs once, with ok False when its `with` block raised."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __enter__(self) -> FinishingFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)

    def close(self, ok: bool = True) -> None:
        if not self._f.closed:
            self._finish(ok)

    def _finish(self, ok: bool) -> None:
        raise NotImplementedError
