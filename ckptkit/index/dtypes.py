"""Dtype names shared by every format: one canonical string per torch dtype."""
from __future__ import annotations

import torch

from ..errors import UnsupportedError

_CANONICAL: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _CANONICAL[getattr(torch, _name)] = _name

_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in _CANONICAL.items()}

# safetensors' dtype codes
_SAFETENSORS = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32",
    "uint64": "U64", "complex64": "C64",
}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS.items()}

FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of a torch dtype ("float32", "bfloat16", ...)."""
    try:
        return _CANONICAL[dtype]
    except KeyError:
        raise UnsupportedError(f"tensor dtype {dtype} is not supported") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnsupportedError(f"dtype {name!r} is not supported by this torch build") from None


def itemsize(name: str) -> int:
    return torch_dtype(name).itemsize


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
        raise UnsupportedError(f"safetensors dtype {code!r} is not supported") from None


def parse_dtype_option(text: str) -> str:
    """Map a user's --dtype spelling (fp32, bf16, float16, ...) to a canonical name."""
    aliases = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
               "bf16": "bfloat16", "fp64": "float64", "double": "float64"}
    name = aliases.get(text.lower(), text.lower())
    if name not in FLOATING:
        raise UnsupportedError(f"--dtype {text!r} is not a floating dtype (use fp32, bf16 or fp16)")
    return name
