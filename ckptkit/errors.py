"""Every failure ckptkit reports is a CkptkitError carrying one sentence a user can act on.

The CLI prints ``str(error)`` and exits non-zero; the sentence names the file, the key and what
was expected versus what was found, so no traceback is ever needed to understand it.
"""
from __future__ import annotations


class CkptkitError(Exception):
    """Base class: one clear sentence, shown to the user as is."""

    exit_code = 2


class NotACheckpointError(CkptkitError):
    """The path exists but no supported checkpoint format recognises it."""


class FormatError(CkptkitError):
    """A file of a known format is malformed, truncated or inconsistent."""


class UnsafePickleError(CkptkitError):
    """A pickle referenced a global outside the allowlist; nothing was executed."""


class UnsupportedError(CkptkitError):
    """A valid checkpoint uses a layout or feature ckptkit does not support (yet)."""


class MissingDependencyError(CkptkitError):
    """An optional package (a codec, deepspeed, ...) is needed for this input."""


class OutputError(CkptkitError):
    """The output location cannot be written (exists, locked, disk full, ...)."""


class UsageError(CkptkitError):
    """Options that contradict each other or the checkpoint (e.g. --from 3 on a 2-rank checkpoint)."""


class VerificationError(CkptkitError):
    """A checkpoint failed verification; ``problems`` lists every finding."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])
