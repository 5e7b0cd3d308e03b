"""Optimizer values kept whole (a step): are two the same, and how much do they weigh."""

from __future__ import annotations

from typing import Any

from ...lazy_torch import is_tensor
from ...safeload import Inert


def same_value(a: Any, b: Any) -> bool:
    """The same value of the same type: stand-ins and containers compared by what they hold, torch
    tensors by dtype, shape and bytes, NaN equal to NaN. A value kept whole must be one value on
    every rank and for every parameter of a group, so "equal" here means "interchangeable"."""
    if type(a) is not type(b):
        return False
    if type(a) is int:  # (a step, for each of 20k parameters: the usual case, answered first)
        return a == b
    if isinstance(a, Inert):
        return same_value(a.to_data(), b.to_data())
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    if is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and _tensor_bytes(a) == _tensor_bytes(b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values of foreign types that cannot compare: treat as different
        return False


def _tensor_bytes(tensor: Any) -> bytes:
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def value_weight(value: Any, limit: int) -> int:
    """Values inside `value` (strings, bytes and tensor data one per 64 bytes), counted up to
    just past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        total += 1
        if isinstance(v, Inert):
            v = v.to_data()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif isinstance(v, (str, bytes, bytearray)):
            total += len(v) >> 6
        else:
            nbytes = getattr(v, "nbytes", 0)  # a tensor's data
            total += nbytes >> 6 if isinstance(nbytes, int) else 0
    return total
