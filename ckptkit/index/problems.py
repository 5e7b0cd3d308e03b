"""Problems a reader may record instead of raising, so `verify` can list every one.

A reader raises on the first damaged file, which is what every command that moves data wants.
`verify` instead wants every problem: inside `collecting()`, a reader that meets a damaged file
or item it can step over calls `tolerate()`, which records the problem (file, key, kind, the
error's sentence) and lets the reader go on with the rest. Outside it, `tolerate()` returns False
and the reader raises as before.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import (
    CkptkitError,
    MissingDependencyError,
    NotACheckpointError,
    UnsafePathError,
    UnsafePickleError,
    UnsupportedError,
)

# The stable identifiers `verify --json` reports as "kind".
MISSING_FILE = "missing_file"
TRUNCATED = "truncated"
CRC_MISMATCH = "crc_mismatch"
COVERAGE_GAP = "coverage_gap"
COVERAGE_OVERLAP = "coverage_overlap"
OUT_OF_BOUNDS = "out_of_bounds"
SIZE_MISMATCH = "size_mismatch"
UNSAFE_PATH = "unsafe_path"
UNSAFE_PICKLE = "unsafe_pickle"
NOT_A_CHECKPOINT = "not_a_checkpoint"
UNSUPPORTED = "unsupported"
MISSING_DEPENDENCY = "missing_dependency"
UNREADABLE = "unreadable"  # a tensor that cannot be assembled from its pieces (--deep)
FORMAT = "format"  # any other malformed content


@dataclass(frozen=True)
class Problem:
    """One finding: `file` is the path of the file it concerns (the checkpoint's own path when it
    concerns the whole), `key` the tensor or entry name or None, `message` one sentence."""

    kind: str
    message: str
    file: str
    key: str | None = None

    def as_json(self) -> dict:
        return {"file": self.file, "key": self.key, "kind": self.kind, "message": self.message}


@dataclass
class ProblemLog:
    problems: list[Problem] = field(default_factory=list)
    damaged: set[str] = field(default_factory=set)  # keys whose pieces a recorded problem made unreadable

    def add(self, problem: Problem) -> None:
        if problem.kind == MISSING_FILE and any(
            p.kind == MISSING_FILE and p.file == problem.file for p in self.problems
        ):
            return  # a missing file is one problem, however many items it held
        self.problems.append(problem)


_LOG: contextvars.ContextVar[ProblemLog | None] = contextvars.ContextVar("ckptkit_problem_log", default=None)


@contextmanager
def collecting() -> Iterator[ProblemLog]:
    """Within this block (this thread), readers record what they can step over into the log."""
    log = ProblemLog()
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def tolerate(
    exc: CkptkitError, file: str, key: str | None = None, kind: str | None = None, damaged: tuple[str, ...] = ()
) -> bool:
    """Record `exc` when collecting (True: go on without that file or item); False: raise it.
    `damaged` names the keys the reader could not complete because of it."""
    log = _LOG.get()
    if log is None:
        return False
    kind = kind or kind_of(exc)
    log.add(Problem(kind, str(exc), file, None if kind == MISSING_FILE else key))  # a file, not an item
    log.damaged.update(damaged)
    if key is not None:
        log.damaged.add(key)
    return True


def tolerate_keys(keys: list[str]) -> None:
    """When collecting: these keys lack pieces because of a problem already recorded."""
    log = _LOG.get()
    if log is not None:
        log.damaged.update(keys)


def collecting_now() -> bool:
    return _LOG.get() is not None


def kind_of(exc: BaseException) -> str:
    """The kind of a problem from its error: its class first, then what its sentence says."""
    if isinstance(exc, UnsafePathError):
        return UNSAFE_PATH
    if isinstance(exc, UnsafePickleError):
        return UNSAFE_PICKLE
    if isinstance(exc, NotACheckpointError):
        return NOT_A_CHECKPOINT
    if isinstance(exc, UnsupportedError):
        return UNSUPPORTED
    if isinstance(exc, MissingDependencyError):
        return MISSING_DEPENDENCY
    text = str(exc)
    if "file is missing" in text or "are missing (found" in text or "no such file" in text:
        return MISSING_FILE
    if "truncated" in text or "ends before byte" in text or "past the end of the file" in text:
        return TRUNCATED
    if "fails its CRC" in text:
        return CRC_MISMATCH
    return FORMAT
