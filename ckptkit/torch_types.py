"""torch's small value types as plain-Python stand-ins, so reading a checkpoint never imports torch.

The restricted unpickler (safeload) builds these for what checkpoints pickle besides tensor
data: torch.Size, dtypes, small tensors loaded whole (a step counter, an RNG state). repickle
writes them back as torch's own objects, with the opcodes pickle writes for the real ones, and
`realize()` turns them into torch objects where values leave ckptkit for torch code or the user
(ObjectEntry.value, diff and convert arithmetic, the Checkpointer's extras).
"""
from __future__ import annotations

import itertools
import math
import struct
from collections import OrderedDict
from typing import Any

from .errors import FormatError, UnsupportedError
from .index.dtypes import ALIASES, FLOATING, itemsize, torch_dtype
from .index.geometry import row_major_strides


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


# the most bytes a non-contiguous tensor loaded whole from a pickle may expand to
MAX_STRIDED_BYTES = 64 << 20
# struct codes of the dtypes SmallTensor.tolist() decodes
_STRUCT = {"float64": "d", "float32": "f", "float16": "e", "int64": "q", "int32": "i", "int16": "h",
           "int8": "b", "uint8": "B", "bool": "?", "uint16": "H", "uint32": "I", "uint64": "Q"}


class SmallTensor:
    """A tensor loaded whole from a pickle (not a model weight): dtype name, shape, and its
    elements' bytes in row-major order. Compares by value."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: str, shape: tuple[int, ...], data: bytes) -> None:
        self.dtype, self.shape, self.data = dtype, tuple(shape), bytes(data)

    @classmethod
    def from_storage(cls, dtype: str, storage: bytes, offset: int, shape: tuple[int, ...],
                     stride: tuple[int, ...]) -> "SmallTensor":
        """The view (offset, shape, stride in elements) of a storage's bytes, made contiguous."""
        item = itemsize(dtype)
        numel = math.prod(shape)
        dense = row_major_strides(tuple(shape))
        if numel == 0 or all(n == 1 or st == want for n, st, want in zip(shape, stride, dense)):
            return cls(dtype, shape, storage[offset * item:(offset + numel) * item])
        if numel * item > MAX_STRIDED_BYTES:  # a small storage viewed as a huge one (stride 0)
            raise FormatError(f"a tensor stored as a strided view of {numel * item} bytes (shape {list(shape)}, "
                              f"strides {list(stride)}) where a small value was expected")
        view = memoryview(storage)
        inner, inner_stride = shape[-1], stride[-1]
        parts = []
        for index in itertools.product(*(range(s) for s in shape[:-1])):
            row = offset + sum(i * st for i, st in zip(index, stride))
            if inner_stride == 1:
                parts.append(view[row * item:(row + inner) * item])
            else:
                parts.extend(view[(row + j * inner_stride) * item:(row + j * inner_stride + 1) * item]
                             for j in range(inner))
        return cls(dtype, shape, b"".join(parts))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def tolist(self) -> list | None:
        """The elements as Python numbers, flat (no torch); None for dtypes Python's struct
        cannot decode (complex, float8)."""
        data = self.data
        if self.dtype == "bfloat16":  # the top half of a float32
            data, code = b"".join(b"\0\0" + data[i:i + 2] for i in range(0, len(data), 2)), "f"
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
        return (isinstance(other, SmallTensor) and (self.dtype, self.shape, self.data)
                == (other.dtype, other.shape, other.data))

    def __hash__(self) -> int:
        return hash((self.dtype, self.shape, self.data))

    def __repr__(self) -> str:
        return f"SmallTensor({self.dtype}, {list(self.shape)}, {self.data.hex()[:32]})"


def realize(value: Any) -> Any:
    """`value` with torch's own objects in place of the stand-ins (imports torch only if it
    holds any); containers are rebuilt, everything else is returned as is."""
    from .safeload import Inert

    if isinstance(value, SmallTensor):
        return value.to_torch()
    if isinstance(value, DType):
        return torch_dtype(value.name)
    if isinstance(value, Size):
        import torch

        return torch.Size(value)
    if isinstance(value, Inert):
        return _realize_inert(value)
    if isinstance(value, GlobalRef) and value.module == "torch":
        import torch

        return getattr(torch, value.name)
    if type(value) is dict or type(value) is OrderedDict:
        return type(value)((k, realize(v)) for k, v in value.items())
    if type(value) is list:
        return [realize(v) for v in value]
    if type(value) is tuple:
        return tuple(realize(v) for v in value)
    return value  # plain values, torch's own objects, other containers


def _realize_inert(value: Any) -> Any:
    """torch.device and layouts become torch's objects; other stand-ins keep their class with
    realized state (a DeepSpeed loss scaler holding a dtype, ...)."""
    qualname = value._qualname
    args = value.__dict__.get("_args", ())
    if qualname == "torch.device":
        import torch

        return torch.device(*args)
    if qualname == "torch.serialization._get_layout":
        import torch

        return getattr(torch, str(args[0]).removeprefix("torch."))
    copy = type(value).__new__(type(value))
    copy.__dict__.update({k: realize(v) for k, v in value.__dict__.items()})
    return copy
