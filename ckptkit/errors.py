"""Every failure ckptkit reports is a CkptkitError carrying one sentence a user can act on.

The CLI prints ``str(error)`` and exits non-zero; the sentence names the file, the key and what
was expected versus what was found, so no traceback is ever needed to understand it.
"""

from __future__ import annotations

from .text import escape_char

QUOTE_LIMIT = 100  # the most characters of a file's content any message shows

_QUOTED = {"\\": "\\\\", "'": "\\'"}


def quote(value: "str | bytes", limit: int = QUOTE_LIMIT) -> str:
    """`value` (text or bytes taken from a file) made safe to put in a message: quoted, at most
    `limit` characters once escaped, with control characters, escape sequences, line breaks,
    undecodable bytes and invisible format characters written as escapes (\\n, \\x1b, \\u202e),
    so a hostile file can neither flood nor repaint the user's terminal through an error."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value[: limit * 4])
        text = data.decode("utf-8", "surrogateescape")
        whole = len(value) <= len(data)
    else:
        text = str(value)
        text, whole = text[: limit * 4], len(text) <= limit * 4
    out: list[str] = []
    used = 0
    for ch in text:
        piece = _escape(ch)
        if used + len(piece) > limit:
            whole = False
            break
        out.append(piece)
        used += len(piece)
    return "'" + "".join(out) + "'" + ("" if whole else "...")


def name_of(value: "str | bytes", limit: int = QUOTE_LIMIT) -> str:
    """A name taken from a file (a tensor key, a tag) for a message: as is when it is short and
    printable, else quote()d (escaped and cut)."""
    if isinstance(value, str) and len(value) <= limit and value.isprintable():
        return value
    return quote(value, limit)


def _escape(ch: str) -> str:
    """As text.escape, plus the quote and the backslash, so a quoted value reads back unambiguously."""
    return _QUOTED.get(ch) or escape_char(ch)


class CkptkitError(Exception):
    """Base class: one clear sentence, shown to the user as is."""

    exit_code = 2


class NotACheckpointError(CkptkitError):
    """The path exists but no supported checkpoint format recognises it."""


class FormatError(CkptkitError):
    """A file of a known format is malformed, truncated or inconsistent."""


class UnsafePathError(FormatError):
    """A file of a local checkpoint leads outside it (a link) or is not a regular file (a FIFO, a
    device, a socket); it was not opened, or closed unread."""


class UnsafePickleError(CkptkitError):
    """A pickle referenced a global outside the allowlist; nothing was executed."""


class UnsupportedError(CkptkitError):
    """A valid checkpoint uses a layout or feature ckptkit does not support (yet)."""


class MissingDependencyError(CkptkitError):
    """An optional package (a codec, deepspeed, ...) is needed for this input."""


class StorageError(CkptkitError):
    """The storage a URL names cannot be opened at all (a protocol fsspec does not know, no
    credentials, a refused connection): bad input, never a problem found in a checkpoint."""


class OutputError(CkptkitError):
    """The output location cannot be written (exists, locked, disk full, ...)."""


class UsageError(CkptkitError):
    """Options that contradict each other or the checkpoint (e.g. --from 3 on a 2-rank checkpoint)."""


class InternalError(Exception):
    """A bug in ckptkit, met while handling a file (not a CkptkitError: the input is not to blame).
    It names the file and keeps the bug as its __cause__; the CLI exits 3 and shows the traceback
    with --debug."""
