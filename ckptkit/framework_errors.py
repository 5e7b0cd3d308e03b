"""The cause inside a framework's wrapped exception, so it is worded like every other error.

torch.distributed.checkpoint runs each rank's step under a catch-all and raises a
CheckpointException whose message is every failing rank's traceback (25 lines for one full disk);
its `failures` maps a rank to (exception, stack summary). torch.save's zip writer turns the
OSError of a failed write (EFBIG, ENOSPC, EIO) into a RuntimeError ('[enforce fail at
inline_container.cc] ... unexpected pos') that keeps the OSError only as its __context__; DeepSpeed's
save_checkpoint passes that RuntimeError on. `framework_cause` digs out what the user can act on:
a ckptkit error or an OSError, first in rank order, else the first rank's own exception (no dump).
"""

from __future__ import annotations

from typing import Any

from .errors import CkptkitError

_CHAIN_LIMIT = 32  # links of __cause__/__context__ followed (a chain can be made to loop)


def framework_cause(exc: BaseException) -> BaseException:
    """The error `exc` wraps (itself when it wraps nothing): a CkptkitError or OSError found in a
    CheckpointException's failures or in an exception's chain, else the first failure itself."""
    found = failures_of(exc)
    for candidate in found:
        named = _named_cause(candidate)
        if named is not None:
            return named
    return found[0] if found else exc


def failures_of(exc: BaseException, depth: int = 0) -> list[BaseException]:
    """The exceptions a CheckpointException holds, by rank (nested ones opened too); [exc] else."""
    failures = getattr(exc, "failures", None) if _is_checkpoint_exception(exc) else None
    if not isinstance(failures, dict) or depth > _CHAIN_LIMIT:
        return [exc]
    out: list[BaseException] = []
    for rank in sorted(failures, key=lambda r: r if isinstance(r, int) else 0):
        value: Any = failures[rank]
        inner = value[0] if isinstance(value, tuple) and value else value
        if isinstance(inner, BaseException):
            out.extend(failures_of(inner, depth + 1))
    return out or [exc]


def _is_checkpoint_exception(exc: BaseException) -> bool:
    kind = type(exc)
    return kind.__name__ == "CheckpointException" and kind.__module__.startswith("torch.distributed.checkpoint")


def _named_cause(exc: BaseException) -> BaseException | None:
    """The first CkptkitError or OSError along exc's __cause__/__context__ chain (exc included)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    for _ in range(_CHAIN_LIMIT):
        if current is None or id(current) in seen:
            return None
        seen.add(id(current))
        if isinstance(current, (CkptkitError, OSError)):
            return current
        current = current.__cause__ or current.__context__
    return None
