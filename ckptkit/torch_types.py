"""torch's small value types as plain-Python stand-ins, so reading a checkpoint never imports torch.

The restricted unpickler (safeload) builds these for what checkpoints pickle besides tensor
data: torch.Size, dtypes, small tensors loaded whole (a step counter, an RNG state). repickle
writes them back as torch's own objects, with the opcodes pickle writes for the real ones, and
`safeload.realize()` turns them into torch objects where values leave ckptkit for torch code or
the user.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from .errors import FormatError, UnsupportedError
from .index.dtypes import ALIASES, FLOATING, itemsize, torch_dtype
from .index.strides import row_major_strides, strided_span


class Size(tuple):
    """torch.Size: a tuple of ints that pickles as torch.Size."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"


class _Interned:
    """One object per key, as torch's dtypes and module globals are: pickle's memo and `is`
    comparisons then treat them as torch treats the real ones; copies are the object itself."""

    _instances: dict[tuple, Any]

    def __new__(cls, *key: Any) -> Any:
        obj = cls._instances.get(key)
        if obj is None:
            obj = super().__new__(cls)
            obj._setup(*key)
            cls._instances[key] = obj
        return obj

    def _setup(self, *key: Any) -> None:
        raise NotImplementedError

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        return self

    def __setstate__(self, state: Any) -> None:
        # one object per key for the whole process: no unpickler may give it a state (pickle's
        # BUILD would otherwise rewrite, say, torch.float32 for every later reader)
        raise TypeError(f"{self!r} takes no pickled state")


class DType(_Interned):
    """A torch dtype by canonical name; one object per name, pickled as the global torch.<name>."""

    _instances: dict[tuple, "DType"] = {}

    def _setup(self, attr: str) -> None:
        self.attr = attr  # the attribute of torch it was pickled as (float, float32, qint8, ...)
        self.name = ALIASES.get(attr, attr)  # canonical name (dtype_name() refuses ones ckptkit cannot hold)

    @property
    def itemsize(self) -> int:
        return itemsize(self.name)

    @property
    def is_floating_point(self) -> bool:
        return self.name in FLOATING

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __reduce__(self):
        return (DType, (self.attr,))


class GlobalRef(_Interned):
    """A reference to `module.name` (torch.strided, a rebuild function, ...), pickled back as a
    GLOBAL opcode by ckptkit.repickle without importing the module; one object per name."""

    _instances: dict[tuple, "GlobalRef"] = {}

    def _setup(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # pickle's save_reduce insists on a callable
        raise TypeError(f"{self.module}.{self.name} is a reference, not the object")

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"

    def __reduce__(self):
        return (GlobalRef, (self.module, self.name))


# the most bytes an overlapping view (a stride 0, or strides that revisit elements) may expand to:
# beyond this its elements outnumber the bytes it was stored in, i.e. a bomb, not a checkpoint value
MAX_STRIDED_BYTES = 64 << 20
# struct codes of the dtypes SmallTensor.tolist() decodes
_STRUCT = {
    "float64": "d",
    "float32": "f",
    "float16": "e",
    "int64": "q",
    "int32": "i",
    "int16": "h",
    "int8": "b",
    "uint8": "B",
    "bool": "?",
    "uint16": "H",
    "uint32": "I",
    "uint64": "Q",
}


def view_problem(offset: object, size: tuple, stride: tuple, item: int, storage_bytes: int) -> str | None:
    """Why a view (storage offset, size, stride, in elements of `item` bytes) cannot be planned over
    a storage of `storage_bytes`, or None when it can.

    Every reader checks this wherever a view becomes bytes to read: negative or malformed numbers,
    a view reaching past its storage, and an overlapping view (stride 0, ...) whose elements would
    expand to more than MAX_STRIDED_BYTES and more than its storage (a small storage viewed as a
    huge tensor)."""
    if len(size) != len(stride):
        return f"size {list(size)[:8]} and stride {list(stride)[:8]} have different lengths"
    for name, values in (("storage offset", (offset,)), ("size", size), ("stride", stride)):
        if any(type(v) is not int or v < 0 for v in values):
            return f"its {name} {list(values)[:8]} is not made of non-negative integers"
    numel = math.prod(size)
    span = strided_span(size, stride)
    end = (offset + span) * item if numel else 0
    if end > storage_bytes:
        return (
            f"its view (offset {offset}, size {list(size)[:8]}, stride {list(stride)[:8]}) needs bytes up to "
            f"{end} of a storage that holds {storage_bytes}"
        )
    if numel > span and numel * item > max(MAX_STRIDED_BYTES, storage_bytes):
        return (
            f"it is a strided view of {numel * item} bytes (size {list(size)[:8]}, stride {list(stride)[:8]}) "
            f"over {span * item} stored bytes: overlapping elements expanding past {MAX_STRIDED_BYTES} bytes"
        )
    return None


class SmallTensor:
    """A tensor loaded whole from a pickle (not a model weight): dtype name, shape, and its
    elements' bytes in row-major order. Compares by value.

    One read of a storage is shared by every view of it: a view built by `from_storage` keeps the
    storage's bytes and its own offset and strides, and copies only its own elements, when `data`
    is asked for (nothing is kept: 2,500 views of one storage hold that storage once)."""

    __slots__ = ("dtype", "shape", "_data", "_view")

    def __init__(self, dtype: str, shape: tuple[int, ...], data: bytes) -> None:
        self.dtype, self.shape, self._data = dtype, tuple(shape), bytes(data)
        self._view: tuple | None = None

    @classmethod
    def from_storage(
        cls, dtype: str, storage: bytes, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> "SmallTensor":
        """The view (offset, shape, stride in elements) of a storage's bytes, sharing them."""
        shape, stride = tuple(shape), tuple(stride)
        problem = view_problem(offset, shape, stride, itemsize(dtype), len(storage))
        if problem is not None:
            raise FormatError(f"a tensor loaded whole is malformed: {problem}")
        obj = cls.__new__(cls)
        obj.dtype, obj.shape, obj._data = dtype, shape, None
        obj._view = (storage, offset, stride)
        return obj

    @property
    def nbytes(self) -> int:
        """Bytes of its elements (what `data` holds), known without building `data`."""
        return self.numel * itemsize(self.dtype)

    @property
    def data(self) -> bytes:
        """The elements' bytes in row-major order (built from the shared storage for a view)."""
        if self._data is not None:
            return self._data
        storage, offset, stride = self._view  # type: ignore[misc]
        return _gather(storage, offset, self.shape, stride, itemsize(self.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def tolist(self) -> list | None:
        """The elements as Python numbers, flat (no torch); None for dtypes Python's struct
        cannot decode (complex, float8)."""
        data = self.data
        if self.dtype == "bfloat16":  # the top half of a float32
            data, code = b"".join(b"\0\0" + data[i : i + 2] for i in range(0, len(data), 2)), "f"
        elif self.dtype in _STRUCT:
            code = _STRUCT[self.dtype]
        else:
            return None
        return [v for (v,) in struct.iter_unpack("<" + code, data)]

    def item(self) -> Any:
        """The one element as a Python number, as torch's Tensor.item() gives it."""
        values = self.tolist() if self.numel == 1 else None
        if not values:
            raise UnsupportedError(f"{self!r} is not a single number")
        return values[0]

    def to_torch(self) -> Any:
        import torch

        dtype = torch_dtype(self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SmallTensor)
            and (self.dtype, self.shape) == (other.dtype, other.shape)
            and self.data == other.data
        )

    def __hash__(self) -> int:
        return hash((self.dtype, self.shape, self.data))

    def __repr__(self) -> str:
        head = self.data[:16] if self.nbytes <= 1 << 20 else b""
        return f"SmallTensor({self.dtype}, {list(self.shape)}, {head.hex()})"


def _gather(storage: bytes, offset: int, shape: tuple[int, ...], stride: tuple[int, ...], item: int) -> bytes:
    """Row-major bytes of a strided view of `storage` (elements of `item` bytes)."""
    numel = math.prod(shape)
    dense = row_major_strides(shape)
    if numel == 0:
        return b""
    if all(n == 1 or st == want for n, st, want in zip(shape, stride, dense)):
        if offset == 0 and numel * item == len(storage) and type(storage) is bytes:
            return storage  # the whole storage: no copy
        return bytes(memoryview(storage)[offset * item : (offset + numel) * item])
    import numpy  # a strided gather in one C loop (no torch needed)
    from numpy.lib.stride_tricks import as_strided

    raw = numpy.frombuffer(storage, dtype=numpy.uint8)
    elements = as_strided(
        raw[offset * item :], shape=(*shape, item), strides=(*(st * item for st in stride), 1), writeable=False
    )
    return elements.tobytes()
