"""Dtype names shared by every format: one canonical string per torch dtype, with its size.

A plain table, so indexes, headers and byte copies never import torch; `torch_dtype()` maps a
name to torch's dtype where a tensor is actually built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedError, quote

if TYPE_CHECKING:
    import torch

# canonical name -> bytes per element
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
}

# torch's other spellings of the same dtypes (torch.float is torch.float32, ...)
ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cfloat": "complex64",
    "cdouble": "complex128",
}

# torch.save's legacy storage classes (torch.FloatStorage, ...) and the dtype each one names
LEGACY_STORAGE: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
STORAGE_OF: dict[str, str] = {dtype: cls for cls, dtype in LEGACY_STORAGE.items()}

# every attribute of torch that is a dtype (torch 2.13), as pickles may name them
TORCH_DTYPE_ATTRS = (
    "bfloat16",
    "bit",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bool",
    "cdouble",
    "cfloat",
    "chalf",
    "complex128",
    "complex32",
    "complex64",
    "double",
    "float",
    "float16",
    "float32",
    "float4_e2m1fn_x2",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "half",
    "int",
    "int1",
    "int16",
    "int2",
    "int3",
    "int32",
    "int4",
    "int5",
    "int6",
    "int64",
    "int7",
    "int8",
    "long",
    "qint32",
    "qint8",
    "quint2x4",
    "quint4x2",
    "quint8",
    "short",
    "uint1",
    "uint16",
    "uint2",
    "uint3",
    "uint32",
    "uint4",
    "uint5",
    "uint6",
    "uint64",
    "uint7",
    "uint8",
)

# safetensors' dtype codes
_SAFETENSORS = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "complex64": "C64",
}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS.items()}

FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}


def dtype_name(dtype: Any) -> str:
    """Canonical name of a dtype: a torch dtype, ckptkit's stand-in for one, or a name."""
    name = getattr(dtype, "name", None) if not isinstance(dtype, str) else dtype
    if name is None:  # a torch.dtype: str() is "torch.float32"
        name = str(dtype).removeprefix("torch.")
    name = ALIASES.get(name, name)
    if name not in ITEMSIZE:
        raise UnsupportedError(f"tensor dtype {dtype} is not supported")
    return name


def torch_dtype(name: str) -> "torch.dtype":
    """torch's dtype for a canonical name (imports torch: only where tensors are built)."""
    import torch

    value = getattr(torch, name, None) if name in ITEMSIZE else None
    if not isinstance(value, torch.dtype):
        raise UnsupportedError(f"dtype {quote(str(name))} is not supported by this torch build")
    return value


def itemsize(name: str) -> int:
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise UnsupportedError(f"dtype {quote(str(name))} is not supported") from None


def is_floating(name: str) -> bool:
    return name in FLOATING


def to_safetensors(name: str) -> str:
    try:
        return _SAFETENSORS[name]
    except KeyError:
        raise UnsupportedError(f"safetensors cannot store dtype {name}") from None


def from_safetensors(code: str) -> str:
    try:
        return _FROM_SAFETENSORS[code]
    except KeyError:
        raise UnsupportedError(f"safetensors dtype {quote(str(code))} is not supported") from None


# Every spelling --dtype accepts (case and surrounding spaces aside), and the dtype it names:
# ours, and torch's names with or without "torch.". Nothing else: the help lists exactly these.
DTYPE_SPELLINGS: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "torch.half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "torch.float": "float32",
}


def parse_dtype_option(text: str) -> str:
    """Map a user's --dtype spelling to a canonical name: one of DTYPE_SPELLINGS, strictly (an
    empty value or another dtype is refused, not ignored or cast to)."""
    spelled = text.strip().lower()
    if not spelled:
        raise UnsupportedError(
            "--dtype is empty: give the dtype to cast floating model tensors to "
            "(fp32, bf16 or fp16), or leave --dtype out to keep their dtypes"
        )
    name = DTYPE_SPELLINGS.get(spelled)
    if name is None:
        raise UnsupportedError(f"--dtype {text!r} is not a floating dtype (use fp32, bf16 or fp16)")
    return name
