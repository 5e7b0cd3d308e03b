"""The grammar's rules for torch's tensor rebuild functions: each checks its arguments (a storage
of the archive, ints below 2**63, a dtype) and builds ckptkit's own tensor, a TensorRef over a
storage's bytes or a SmallTensor from bytes already read, never torch's.
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError, UnsupportedError, quote
from ..index.dtypes import dtype_name
from ..torch_types import DType, Size, SmallTensor
from .refs import RawStorage, StorageRef, TensorRef, TypedStorage
from .rules import Refused

_INT = {int}
_I64 = 1 << 63
MAX_DIMS = 64


def checked_ints(value: Any, what: str, low: int = 0) -> tuple:
    """A tuple (or list, or torch.Size) of at most 64 ints in [low, 2**63)."""
    t = type(value)
    if t is tuple and len(value) == 1 and type(value[0]) is int and low <= value[0] < _I64:
        return value  # (a flat tensor's size or stride: the common case, checked without a set)
    if (
        (t is not tuple and t is not list and t is not Size)
        or len(value) > MAX_DIMS
        or (value and (not set(map(type, value)) <= _INT or min(value) < low or max(value) >= _I64))
    ):
        raise Refused(f"{what} must be a tuple of at most {MAX_DIMS} integers in [{low}, 2**63)")
    return value if t is tuple else tuple(value)


def _int(value: Any, what: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value < _I64:
        raise Refused(f"{what} must be an integer in [{low}, 2**63)")
    return value


# ---- tensors (ours, never torch's) ------------------------------------------------------------


def _storage(value: Any) -> Any:
    if not isinstance(value, (TypedStorage, StorageRef, RawStorage)):
        raise Refused("the first argument must be a storage of the archive")
    return value


def _make_tensor(storage: Any, dtype: DType, offset: int, size: tuple, stride: tuple, requires_grad: bool) -> Any:
    if not isinstance(dtype, DType):
        raise FormatError(f"tensor rebuilt with {quote(repr(dtype), 60)} where a dtype was expected")
    if len(size) != len(stride):
        raise FormatError(
            f"tensor rebuilt with size {list(size)[:8]} and stride {list(stride)[:8]} of different lengths"
        )
    if isinstance(storage, StorageRef):
        return TensorRef(storage, dtype, offset, size, stride, requires_grad)
    if isinstance(storage, RawStorage):
        item = _itemsize(dtype)
        span = 0 if 0 in size else 1 + sum((n - 1) * st for n, st in zip(size, stride))
        if (offset + span) * item > len(storage.data):
            raise FormatError(
                f"a tensor needs {(offset + span) * item} bytes of a storage that holds {len(storage.data)}"
            )
        return SmallTensor.from_storage(dtype_name(dtype), storage.data, offset, size, stride)
    raise FormatError(f"tensor rebuilt from an unexpected storage object {type(storage).__name__}")


def _itemsize(dtype: DType) -> int:
    try:
        return dtype.itemsize
    except UnsupportedError:
        raise UnsupportedError(f"tensors of dtype {dtype.attr} are not supported") from None


def _storage_dtype(storage: Any) -> DType:
    if isinstance(storage, (TypedStorage, StorageRef)):
        return storage.dtype
    return DType("uint8")


def _unwrap(storage: Any) -> Any:
    return storage.ref if isinstance(storage, TypedStorage) else storage


def _tensor_tail(args: tuple, first: int) -> None:
    """requires_grad, backward_hooks, metadata: a bool, an empty-or-not dict, None or a dict."""
    names = ("requires_grad", "backward_hooks", "metadata")
    for name, value in zip(names, args[first:]):
        if name == "requires_grad" and type(value) is not bool:
            raise Refused("requires_grad must be a bool")
        if name != "requires_grad" and value is not None and not isinstance(value, dict):
            raise Refused(f"{name} must be a dict or None")


def rebuild_tensor_v2(args: tuple) -> Any:
    """torch._utils._rebuild_tensor_v2(storage, offset, size, stride[, requires_grad, hooks, metadata])."""
    if not 4 <= len(args) <= 7:
        raise Refused("takes 4 to 7 arguments")
    storage = _storage(args[0])
    offset = _int(args[1], "the storage offset")
    size, stride = checked_ints(args[2], "the size"), checked_ints(args[3], "the stride")
    _tensor_tail(args, 4)
    requires_grad = bool(args[4]) if len(args) > 4 else False
    return _make_tensor(_unwrap(storage), _storage_dtype(storage), offset, size, stride, requires_grad)


def rebuild_tensor_v3(args: tuple) -> Any:
    """torch._utils._rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype[, metadata])."""
    if not 7 <= len(args) <= 8:
        raise Refused("takes 7 or 8 arguments")
    storage = _storage(args[0])
    offset = _int(args[1], "the storage offset")
    size, stride = checked_ints(args[2], "the size"), checked_ints(args[3], "the stride")
    _tensor_tail(args[:6], 4)
    if not isinstance(args[6], DType):
        raise Refused("the dtype must be a torch dtype")
    if len(args) == 8 and args[7] is not None and not isinstance(args[7], dict):
        raise Refused("metadata must be a dict or None")
    return _make_tensor(_unwrap(storage), args[6], offset, size, stride, args[4])


def rebuild_tensor(args: tuple) -> Any:
    """torch._utils._rebuild_tensor(storage, offset, size, stride)."""
    if len(args) != 4:
        raise Refused("takes 4 arguments")
    return rebuild_tensor_v2(args)


def rebuild_parameter(args: tuple) -> Any:
    """torch._utils._rebuild_parameter(data, requires_grad, hooks[, state]): the tensor itself."""
    if not 3 <= len(args) <= 4:
        raise Refused("takes 3 or 4 arguments")
    if not isinstance(args[0], (TensorRef, SmallTensor)) or type(args[1]) is not bool:
        raise Refused("takes a tensor and a bool")
    if args[2] is not None and not isinstance(args[2], dict):
        raise Refused("backward_hooks must be a dict or None")
    return args[0]
