"""Tensors and values of an opened torch.save archive: where a lazily described tensor's bytes
lie in its storage member (checked: a view never reads zip headers or a neighbour's bytes), and
non-tensor values loaded whole (`load_values`), within the share of the memory budget a value may
take.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import FormatError
from ..index.dtypes import ITEMSIZE, dtype_name
from ..index.geometry import row_major_strides, strided_span
from ..index.types import Location
from ..safeload import TensorRef
from ..torch_types import SmallTensor, view_problem
from . import limits
from .structure_memo import StructureMemo
from .zip_directory import Archive, Member


def tensor_span_elems(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from the first to the last element of a strided view (0 when empty)."""
    return strided_span(tuple(size), tuple(stride))


def is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def tensor_location(
    archive: Archive, ref: TensorRef, what: str, memo: StructureMemo | None = None
) -> tuple[str, Location]:
    """The dtype name and byte location of a lazily described tensor, checked against its storage:
    a view that is malformed (negative offset, ...), reaches past its storage or expands a few
    stored bytes into a huge tensor is refused, so the piece's bytes always lie inside its storage
    member's data (never the zip headers before it or the member after it). `memo`: the outcome
    for the same TensorRef (one a StructureMemo hit shares) over a storage member of the same size.
    An empty view that empty_view() passes needs none of the checks: it is located at once."""
    member = archive.storage_member(ref.storage.key)
    if empty_view(
        ref
    ):  # no bytes, and a view locate_view accepts over any storage (a ZeRO-3 module's 20k placeholders)
        known = (dtype_name(ref.dtype), 0, 0, None if is_contiguous(ref.size, ref.stride) else tuple(ref.stride))
    else:
        known = memo.located(ref, member.size) if memo is not None else None
        if known is None:
            known = locate_view(archive, ref, what, member)
            if memo is not None:
                memo.locate(ref, member.size, known)
    dtype, start, length, stride = known
    return dtype, Location(archive.file, member.data_offset + start, length, stride=stride)


def empty_view(ref: TensorRef) -> bool:
    """True when `ref` has no elements and tensor_location would accept it over any storage of
    its archive (offset 0, sizes and strides non-negative ints of one length, dtypes ckptkit
    holds): a reader that skips empty tensors need not locate it. False sends it through
    tensor_location, which words whatever is wrong."""
    size, stride = ref.size, ref.stride
    return (
        type(ref.storage_offset) is int
        and ref.storage_offset == 0
        and type(size) is tuple
        and type(stride) is tuple
        and len(size) == len(stride)
        and 0 in size
        and all(type(v) is int and v >= 0 for v in size)
        and all(type(v) is int and v >= 0 for v in stride)
        and ref.dtype.name in ITEMSIZE
        and ref.storage.dtype.name in ITEMSIZE
    )


def locate_view(archive: Archive, ref: TensorRef, what: str, member: Member) -> tuple[str, int, int, tuple | None]:
    """tensor_location's checks: the dtype name, the view's start and length in its storage
    member's data, and its strides (None when contiguous)."""
    item = ref.dtype.itemsize
    storage_bytes = min(member.size, ref.storage.numel * ref.storage.dtype.itemsize)
    problem = view_problem(ref.storage_offset, tuple(ref.size), tuple(ref.stride), item, storage_bytes)
    if problem is not None:
        raise FormatError(f"{archive.label}: tensor {what} of storage {ref.storage.key}: {problem}")
    span = strided_span(tuple(ref.size), tuple(ref.stride))
    start, length = ref.storage_offset * item, span * item
    if not (0 <= start and start + length <= member.size):  # view_problem guarantees it; never read headers
        raise FormatError(f"{archive.label}: tensor {what} lies outside its storage member {member.name}")
    stride = None if is_contiguous(ref.size, ref.stride) else tuple(ref.stride)
    return dtype_name(ref.dtype), start, length, stride


def load_values(archive: Archive, value: Any) -> Any:
    """`value` (a non-tensor value of a lazily loaded archive: a step, a tuple of tensors, ...)
    with its TensorRefs replaced by SmallTensors.

    Each storage is read once per call, only the byte range its views need, and shared by them
    (pass every value of an archive in one call); the views' sizes, summed over every call for
    this archive, may not exceed limits.value_bytes() (2,500 views of one 1 MB storage would
    otherwise become 2.5 GB of copies), nor the bytes read the file's size."""
    refs: list[tuple[TensorRef, str, Location]] = []
    _collect(archive, value, refs, set())
    if not refs:
        return value
    ranges: dict[str, tuple[int, int]] = {}
    for ref, _, loc in refs:
        lo, hi = ranges.get(ref.storage.key, (loc.offset, loc.offset + loc.length))
        ranges[ref.storage.key] = (min(lo, loc.offset), max(hi, loc.offset + loc.length))
    archive.values_built += sum(math.prod(ref.size) * ref.dtype.itemsize for ref, _, _ in refs)
    archive.values_read += sum(hi - lo for lo, hi in ranges.values())
    check_whole(archive.label, archive.values_built)
    if archive.values_read > max(1 << 20, archive.source.size(archive.file)):
        raise FormatError(
            f"{archive.label}: its values would read {archive.values_read} bytes, more than the "
            f"file holds (the same storage bytes over and over)"
        )
    reads = {key: (lo, archive.read(lo, hi - lo)) for key, (lo, hi) in ranges.items()}
    built: dict[int, SmallTensor] = {}
    for ref, dtype, loc in refs:
        lo, raw = reads[ref.storage.key]
        item = ref.dtype.itemsize
        stride = loc.stride if loc.stride is not None else row_major_strides(tuple(ref.size))
        built[id(ref)] = (
            SmallTensor.from_storage(dtype, raw, (loc.offset - lo) // item, tuple(ref.size), stride)
            if (loc.offset - lo) % item == 0
            else _unaligned(dtype, raw, loc.offset - lo, ref, stride)
        )
    return _replace(value, built)


def check_whole(label: str, nbytes: int) -> None:
    """Tensors loaded whole from one archive (counted per view: each is copied where it is used,
    re-pickled by convert, ...) must fit the share of the memory budget a value may take."""
    cap = limits.value_bytes()
    if nbytes > cap:
        raise FormatError(
            f"{label}: its values hold tensors loaded whole of {nbytes} bytes in all (every view "
            f"of a shared storage counted), more than a quarter of the memory budget ({cap} bytes); "
            f"raise --memory-budget if this is expected"
        )


def whole_bytes(value: Any) -> int:
    """Bytes of the distinct SmallTensors in a loaded value (each view its own), walking
    containers and stand-ins' state without recursion."""
    total, stack, seen = 0, [value], set()
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes, bytearray, int, float, bool)) or v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, SmallTensor):
            total += v.nbytes
        elif isinstance(v, (dict, list, tuple, set, frozenset)) or hasattr(v, "__dict__"):
            if isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, (list, tuple, set, frozenset)):
                stack.extend(v)
            else:
                stack.extend(vars(v).values())
    return total


def _unaligned(dtype: str, raw: bytes, start: int, ref: TensorRef, stride: tuple[int, ...]) -> SmallTensor:
    """A view whose first byte is not on an element boundary of the shared read (views of one
    storage with different dtypes): its own bytes, sliced once."""
    span = strided_span(tuple(ref.size), tuple(stride)) * ref.dtype.itemsize
    return SmallTensor.from_storage(dtype, raw[start : start + span], 0, tuple(ref.size), stride)


def _collect(archive: Archive, value: Any, out: list, seen: set) -> None:
    """The distinct TensorRefs nested in `value`, located (checked) in the archive."""
    stack = [value]
    while stack:
        v = stack.pop()
        if not isinstance(v, (TensorRef, dict, list, tuple)) or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, TensorRef):
            dtype, loc = tensor_location(archive, v, "nested tensor")
            out.append((v, dtype, loc))
        else:
            stack.extend(reversed(list(v.values() if isinstance(v, dict) else v)))


def _replace(value: Any, built: dict[int, SmallTensor]) -> Any:
    if isinstance(value, TensorRef):
        return built[id(value)]
    if isinstance(value, dict):
        return (
            type(value)((k, _replace(v, built)) for k, v in value.items())
            if type(value) is not dict
            else {k: _replace(v, built) for k, v in value.items()}
        )
    if isinstance(value, list):
        return [_replace(v, built) for v in value]
    if type(value) is tuple:
        return tuple(_replace(v, built) for v in value)
    return value
