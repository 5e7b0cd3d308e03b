"""Entries of DeepSpeed's pickled structures, checked as they are taken: one sentence naming the
file and the entry when one is missing or malformed."""

from __future__ import annotations

from typing import Any

from ...errors import FormatError
from ...index.types import Location
from ...safeload import TensorRef
from ...runner.torch_archive import Archive, tensor_location


def entry(mapping: Any, key: str, where: str) -> Any:
    if not isinstance(mapping, dict) or key not in mapping:
        raise FormatError(f"{where}: has no {key!r} entry (not a DeepSpeed ZeRO checkpoint of a known version)")
    return mapping[key]


def shape_of(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(d, int) and d >= 0 for d in value):
        raise FormatError(f"{where}: malformed shape {value!r:.60}")
    return tuple(int(d) for d in value)


def plain_shape(value: Any) -> tuple[int, ...] | None:
    """shape_of's answer for the usual shape (a tuple or list of plain non-negative ints, a
    torch.Size), without a message to word; None for any other (shape_of then says what is wrong)."""
    if isinstance(value, (tuple, list)):
        shape = tuple(value)
        if all(type(d) is int and d >= 0 for d in shape):
            return shape
    return None


def tensor_of(archive: Archive, value: Any, what: str) -> tuple[str, Location, tuple[int, ...]]:
    """(dtype, location, shape) of a tensor entry."""
    if not isinstance(value, TensorRef):
        raise FormatError(f"{archive.label}: {what} is not a tensor (found {type(value).__name__})")
    dtype, loc = tensor_location(archive, value, what)
    return dtype, loc, tuple(value.size)


def refuse_strided(arch: Archive, loc: Location, what: str) -> None:
    """A flat partition is cut into per-parameter byte ranges of its storage, so it must be stored
    contiguous, as DeepSpeed saves it: a strided or expanded view (a crafted file) would otherwise
    be read as the wrong elements, or as bytes past its storage."""
    if loc.stride is not None:
        raise FormatError(
            f"{arch.label}: {what} is stored as a strided view (strides {list(loc.stride)}), "
            f"expected a contiguous flat tensor"
        )
