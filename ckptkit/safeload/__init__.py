"""The one place ckptkit unpickles anything: data only, within limits.

`restricted_loads` runs a pickle through ckptkit's own pickle machine (safeload.vm) under an
explicit grammar (safeload.grammar, safeload.numpy): each global a checkpoint may name is either
plain data (a dtype, a stand-in class) or a call whose arguments are checked before anything is
built. Tensors are rebuilt by our own functions (lazily, as references to storage bytes, or eagerly
from bytes we read); the classes a checkpoint's metadata references (DCP metadata, DeepSpeed's
small state classes) become inert stand-ins that only hold data, and only they may be given a
state (BUILD); numpy arrays are rebuilt from their raw bytes, never through numpy's __setstate__.
Object count, nesting depth, expanded size (shared parts counted each time they are reached) and
byte sizes are bounded while unpickling (ckptkit.knobs). Any other global raises
UnsafePickleError naming the file and the global, any limit a FormatError naming the file and the
limit: no checkpoint can run code, and reading needs neither deepspeed nor torch.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import CkptkitError, FormatError, InternalError, quote
from . import dcp, torchsave
from .grammar import RestrictedGrammar, table
from .inert import Inert, inert_class, public_state_of, qualname_of
from .realize import realize
from .refs import RawStorage, StorageRef, TensorRef, storage_pid, typed_storage
from .rules import extra_allowed, register_allowed
from .vm import run

# the names readers and writers take from here (defined beside the unpickler, re-exported)
__all__ = [
    "Inert",
    "RawStorage",
    "StorageRef",
    "TensorRef",
    "allowlist",
    "extra_allowed",
    "inert_class",
    "public_state_of",
    "qualname_of",
    "fenced_torch_save_loads",
    "register_allowed",
    "realize",
    "restricted_loads",
    "restricted_loads_dcp_metadata",
    "storage_pid",
    "typed_storage",
]


def allowlist() -> dict[tuple[str, str], Any]:
    """Every global a checkpoint may name, and what it stands for (numpy's come on demand)."""
    return {**table()[0], **extra_allowed()}


class _RestrictedUnpickler:
    """One restricted load: ckptkit's grammar (safeload.grammar) run by the data-only pickle
    machine (safeload.vm) under the limits of ckptkit.knobs."""

    def __init__(self, data: bytes, file: str, persistent_load: Callable[[Any], Any] | None) -> None:
        self._data = data
        self._file = file
        self._persistent = persistent_load

    def load(self) -> Any:
        return run(self._data, RestrictedGrammar(self._file, self._persistent))


def restricted_loads(data: bytes, file: str, persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle `data` as data only, within limits. A refusal or malformed input is a CkptkitError naming
    `file`; any other exception is ckptkit's own bug, raised as an InternalError (exit 3) with its cause
    kept, never disguised as bad input."""
    try:
        return _RestrictedUnpickler(data, file, persistent_load).load()
    except CkptkitError as exc:
        if str(exc).startswith(file):
            raise
        raise _with_file(exc, file) from None
    except RecursionError:
        raise FormatError(f"{file}: pickle is nested too deeply to be a checkpoint") from None
    except MemoryError:
        raise FormatError(f"{file}: pickle needs more memory than this machine has") from None
    except Exception as exc:  # refusals and malformed input are CkptkitErrors: anything else is a bug
        raise InternalError(
            f"{file}: the restricted unpickler failed on its own ({type(exc).__name__}: {quote(str(exc))})"
        ) from exc


def restricted_loads_dcp_metadata(data: bytes, file: str) -> Any:
    """A DCP `.metadata`: through the fenced C unpickler (safeload.dcp) when it is torch's own
    shape, which gives what the restricted machine would, 5x faster; else `restricted_loads`."""
    value = dcp.load(data)
    return value if value is not None else restricted_loads(data, file)


def fenced_torch_save_loads(data: bytes, persistent_load: Callable[[Any], Any]) -> Any | None:
    """A torch.save data.pkl loaded lazily through the fenced C unpickler (safeload.torchsave),
    or None where it declines: the caller then runs `restricted_loads` (and undoes what its
    `persistent_load` recorded)."""
    return torchsave.load(data, persistent_load)


def _with_file(exc: CkptkitError, file: str) -> CkptkitError:
    new = type(exc).__new__(type(exc))
    new.args = (f"{file}: {exc}",)
    new.__dict__.update(exc.__dict__)
    return new
