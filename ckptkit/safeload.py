"""The one place ckptkit unpickles anything: data only, within limits.

`restricted_loads` runs a pickle through ckptkit's own pickle machine (safeload_vm) under an
explicit grammar (safeload_grammar, safeload_numpy): each global a checkpoint may name is either
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

import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import CkptkitError, FormatError, InternalError, quote
from .torch_types import DType


_HASH_SALT = int.from_bytes(os.urandom(8), "little")


@dataclass(frozen=True)
class StorageRef:
    """A storage of a torch.save archive, not loaded: its member key, dtype and element count."""

    key: str
    dtype: DType
    numel: int


@dataclass(frozen=True)
class RawStorage:
    """A storage read whole (eager loading of a small pickle): its bytes."""

    data: bytes


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a torch.save archive described without loading it (a view of a storage)."""

    storage: StorageRef
    dtype: DType
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False


class Inert:
    """A foreign object rebuilt as plain data: constructor arguments and pickled state only."""

    _qualname = "Inert"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args
        if kwargs:
            self.__dict__["_kwargs"] = kwargs

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def __reduce__(self):  # re-emitting a stand-in pickles it as the original class
        return (_inert_rebuild, (self._qualname, self.__dict__.get("_args", ())), self._public_state())

    def _public_state(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_args", "_kwargs")}

    def to_data(self) -> dict:
        """A JSON-friendly view: class name, arguments, state."""
        out: dict[str, Any] = {"__class__": self._qualname}
        if self.__dict__.get("_args"):
            out["args"] = list(self.__dict__["_args"])
        out.update(self._public_state())
        return out

    def __repr__(self) -> str:
        args = self.__dict__.get("_args", ())
        body = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in self._public_state().items()])
        return f"{self._qualname.rsplit('.', 1)[-1]}({body})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __hash__(self) -> int:
        # by class and every hashable field: stand-ins are dict keys in DCP metadata (MetadataIndex),
        # and a hash by class alone makes a dict of thousands of them quadratic; salted per process
        # so that a pickle cannot craft thousands of keys with one hash (quadratic again)
        parts: list[Any] = [_HASH_SALT, self._qualname]
        for name, value in self.__dict__.items():
            try:
                parts.append((name, hash(value)))
            except TypeError:
                continue
        return hash(tuple(parts))


def _inert_rebuild(qualname: str, args: tuple) -> Inert:
    return inert_class(qualname)(*args)


_INERT_CLASSES: dict[str, type] = {}


def inert_class(qualname: str) -> type:
    """The stand-in class for a foreign `module.Name` (one class per name, cached)."""
    cls = _INERT_CLASSES.get(qualname)
    if cls is None:
        cls = type(qualname.rsplit(".", 1)[-1], (Inert,), {"_qualname": qualname})
        _INERT_CLASSES[qualname] = cls
    return cls


@dataclass(frozen=True)
class _TypedStorage:
    """What persistent_load returns: the storage plus the dtype its legacy class named."""

    ref: Any
    dtype: DType


class _StorageType:
    """Stand-in for torch's legacy `torch.FloatStorage`-style classes: only names a dtype."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype


_EXTRA: dict[tuple[str, str], Any] = {}


def register_allowed(module: str, name: str, value: Any) -> None:
    """Let a format add inert stand-ins for its own classes (e.g. DeepSpeed's loss scaler): an
    Inert subclass may be called and built like the DCP classes; any other value is data only."""
    _EXTRA[(module, name)] = value


def extra_allowed() -> dict[tuple[str, str], Any]:
    return dict(_EXTRA)


def allowlist() -> dict[tuple[str, str], Any]:
    """Every global a checkpoint may name, and what it stands for (numpy's come on demand)."""
    from .safeload_grammar import table

    return {**table()[0], **_EXTRA}


class _RestrictedUnpickler:
    """One restricted load: ckptkit's grammar (safeload_grammar) run by the data-only pickle
    machine (safeload_vm) under the limits of ckptkit.knobs."""

    def __init__(self, data: bytes, file: str, persistent_load: Callable[[Any], Any] | None) -> None:
        self._data = data
        self._file = file
        self._persistent = persistent_load

    def load(self) -> Any:
        from .safeload_grammar import RestrictedGrammar
        from .safeload_vm import run

        return run(self._data, RestrictedGrammar(self._file, self._persistent))


def restricted_loads(data: bytes, file: str,
                     persistent_load: Callable[[Any], Any] | None = None) -> Any:
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
        raise InternalError(f"{file}: the restricted unpickler failed on its own ({type(exc).__name__}: "
                            f"{quote(str(exc))})") from exc


def _with_file(exc: CkptkitError, file: str) -> CkptkitError:
    new = type(exc).__new__(type(exc))
    new.args = (f"{file}: {exc}",)
    new.__dict__.update(exc.__dict__)
    return new


def storage_pid(pid: Any, file: str) -> tuple[str, DType, int]:
    """Decode torch.save's persistent id ('storage', type, key, location, numel)."""
    if not (type(pid) is tuple and len(pid) == 5 and pid[0] in ("storage", b"storage")):
        raise FormatError(f"{file}: unexpected persistent id {quote(repr(pid)[:200], 80)} in a torch.save archive")
    _, storage_type, key, _location, numel = pid
    if not isinstance(storage_type, _StorageType):
        raise FormatError(f"{file}: persistent id names an unknown storage type {quote(repr(storage_type), 60)}")
    if type(key) not in (str, bytes) or type(numel) is not int or numel < 0:
        raise FormatError(f"{file}: persistent id {quote(repr(pid)[:200], 80)} lacks a storage key and an "
                          f"element count")
    key = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    return key, storage_type.dtype, numel


def typed_storage(ref: Any, dtype: DType) -> _TypedStorage:
    return _TypedStorage(ref, dtype)
