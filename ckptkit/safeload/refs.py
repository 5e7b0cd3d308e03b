"""What the restricted unpickler returns for a torch.save archive's tensors: references to storage
bytes (StorageRef, TensorRef) or bytes read whole (RawStorage), never tensors, and the decoding of
torch's persistent ids that name those storages.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import FormatError, quote
from ..torch_types import DType


class _Sealed:
    """Made by the grammar's rules from checked values: no unpickler may give it a state (pickle's
    BUILD writes a frozen dataclass's __dict__ directly); pickled again through its constructor."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise TypeError(f"a {type(self).__name__} takes no pickled state")

    def __reduce__(self):
        return type(self), tuple(getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]


@dataclass(frozen=True)
class StorageRef(_Sealed):
    """A storage of a torch.save archive, not loaded: its member key, dtype and element count."""

    key: str
    dtype: DType
    numel: int


@dataclass(frozen=True)
class RawStorage(_Sealed):
    """A storage read whole (eager loading of a small pickle): its bytes."""

    data: bytes


@dataclass(frozen=True)
class TensorRef(_Sealed):
    """A tensor of a torch.save archive described without loading it (a view of a storage)."""

    storage: StorageRef
    dtype: DType
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False


@dataclass(frozen=True)
class _TypedStorage(_Sealed):
    """What persistent_load returns: the storage plus the dtype its legacy class named."""

    ref: Any
    dtype: DType


class _StorageType:
    """Stand-in for torch's legacy `torch.FloatStorage`-style classes: only names a dtype."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype

    def __setstate__(self, state: Any) -> None:  # one per class name for the whole process
        raise TypeError("a storage type takes no pickled state")

    def __reduce__(self):
        return _StorageType, (self.dtype,)


# the names the grammar and the fenced road use; the classes keep their own names, which refusal
# sentences show (`type(value).__name__`)
TypedStorage = _TypedStorage
StorageType = _StorageType


def storage_pid(pid: Any, file: str) -> tuple[str, DType, int]:
    """Decode torch.save's persistent id ('storage', type, key, location, numel)."""
    if not (type(pid) is tuple and len(pid) == 5 and pid[0] in ("storage", b"storage")):
        raise FormatError(f"{file}: unexpected persistent id {quote(repr(pid)[:200], 80)} in a torch.save archive")
    _, storage_type, key, _location, numel = pid
    if not isinstance(storage_type, _StorageType):
        raise FormatError(f"{file}: persistent id names an unknown storage type {quote(repr(storage_type), 60)}")
    if type(key) is bytes:  # torch.load looks for the record data/b'...' (the bytes' repr), not data/...
        raise FormatError(
            f"{file}: persistent id {quote(repr(pid)[:200], 80)} names its storage key as bytes; "
            f"torch.save writes text, and torch.load would look for another record"
        )
    if type(key) is not str or type(numel) is not int or numel < 0:
        raise FormatError(
            f"{file}: persistent id {quote(repr(pid)[:200], 80)} lacks a storage key and an element count"
        )
    return key, storage_type.dtype, numel


def typed_storage(ref: Any, dtype: DType) -> TypedStorage:
    return _TypedStorage(ref, dtype)
