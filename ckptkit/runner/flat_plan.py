"""The 1-D read planner: byte ranges of a flat element range of a tensor whose pieces are flat.

A ZeRO partition is a 1-D virtual tensor of thousands of "ref" pieces, each a flat range of a
parameter that is itself stored as flat ranges of the source ranks' buffers. Planning that
through N-d boxes (plan.Planner) costs a box decomposition, an intersection and a span object
per piece per level; here it is an interval sweep over the pieces sorted by start (bisect to the
first one), and adjacent byte ranges of one file come out as one range.

It answers only the simple cases, exactly as the N-d planner would (tests/test_flat_plan.py
checks that on random flat layouts): every piece a FlatRange, the whole tensor, or a box of a 1-D
tensor, stored raw and contiguous, as zeros, as an in-memory small value, or as a reference. For
anything else, and for anything wrong (a read past a piece's bytes, an unknown reference), it
returns None and the caller plans through boxes, which gives the same bytes or the same error.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping

from ..errors import FormatError
from ..index.dtypes import itemsize
from ..index.types import Box, Encoding, FlatRange, TensorEntry
from ..torch_types import SmallTensor

__all__ = ["coalesce", "flat_byte_ranges"]

ByteRange = tuple["str | bytes | None", int, int]
_ENCODINGS = {e.value: e for e in Encoding}
_RAW, _ZEROS, _INLINE, _REF = Encoding.RAW, Encoding.ZEROS, Encoding.INLINE, Encoding.REF


class _NotSimple(Exception):
    """Internal: the range is not planned here (the caller plans it through boxes)."""


def runs(entry: TensorEntry) -> tuple[list[int], list[int], list[int]] | None:
    """The entry's non-empty pieces as flat runs sorted by start: (starts, ends, piece indexes),
    meeting end to end over [0, numel), every empty piece inside the tensor: so the pieces tile
    it exactly (what plan.check_tiling asks). None when a piece is not a flat run this planner
    reads (an N-d box, a strided one) or the runs do not tile the tensor."""
    shape = tuple(entry.shape)
    one_d = len(shape) == 1
    numel = entry.numel
    starts: list[int] = []
    ends: list[int] = []
    order: list[int] = []
    pos = 0  # where the next run starts when the pieces come in order (the usual case: no sort)
    in_order = True
    for i, piece in enumerate(entry.pieces):
        region = piece.region
        if type(region) is FlatRange:
            start, length = region.start, region.length
        elif type(region) is Box and (
            (one_d and len(region.sizes) == 1) or (region.sizes == shape and not any(region.offsets))
        ):
            if piece.location.stride is not None:
                return None
            start, length = (region.offsets[0] if one_d else 0), region.sizes[0] if one_d else numel
        else:
            return None
        if length > 0:
            in_order = in_order and start == pos
            pos = start + length
            starts.append(start)
            ends.append(pos)
            order.append(i)
        elif length < 0 or start < 0 or start > numel:
            return None  # a negative or out-of-bounds empty piece: refused by the box planner
    if in_order:
        return (starts, ends, order) if pos == numel else None
    triples = sorted(zip(starts, ends, order))
    pos = 0
    for start, end, _ in triples:
        if start != pos:
            return None
        pos = end
    if pos != numel:
        return None
    return [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]


def flat_byte_ranges(
    entry: TensorEntry,
    start: int,
    length: int,
    *,
    tensors: Mapping[str, TensorEntry] | None,
    tiling: Callable[[TensorEntry], None],
    boxed: Callable[[TensorEntry, int, int], "list[ByteRange] | None"],
    file_sizes: Mapping[str, int] | None = None,
    cache: dict[int, tuple[TensorEntry, tuple]] | None = None,
) -> list[ByteRange] | None:
    """Elements [start, start+length) of `entry`'s flattening as coalesced byte ranges (see
    plan.plan_byte_ranges for their form), or None: not planned here. Ranges come only when
    `entry`'s pieces are flat runs tiling it exactly (runs(): plan.byte_ranges checks the tiling
    of the rest); `tiling` checks a referenced tensor's; `boxed` plans a referenced range
    through boxes where that tensor's pieces are not flat (None: not simple); `cache` keeps
    the runs of referenced tensors by id (the entry held alongside, so ids stay unique)."""
    if start < 0 or length < 0 or start + length > entry.numel:
        return None
    out: list[ByteRange] = []
    try:
        found = _ranges(entry, start, start + length, out, tensors, tiling, boxed, file_sizes, cache, None)
    except (_NotSimple, FormatError):  # the box planner gives its own answer, or its own refusal
        return None
    return out if found else None


def _ranges(
    entry: TensorEntry,
    start: int,
    end: int,
    out: list[ByteRange],
    tensors: Mapping[str, TensorEntry] | None,
    tiling: Callable[[TensorEntry], None],
    boxed: Callable[[TensorEntry, int, int], "list[ByteRange] | None"],
    file_sizes: Mapping[str, int] | None,
    cache: dict | None,
    known: tuple | None,
) -> bool:
    """Append the ranges of [start, end) of entry; False when its pieces are not flat runs."""
    table = known or runs(entry)
    if table is None:
        return False
    starts, ends, order = table
    item = itemsize(entry.dtype)
    pieces = entry.pieces
    k = max(0, bisect_right(starts, start) - 1)
    pos = start
    while pos < end:
        piece = pieces[order[k]]
        lo = starts[k]
        hi = ends[k] if ends[k] < end else end
        n = hi - pos
        local = pos - lo
        loc = piece.location
        encoding = _ENCODINGS.get(loc.encoding)
        if encoding is _RAW:
            first = local * item
            if first + n * item > loc.length:
                raise _NotSimple  # a read past the piece's bytes: the box planner says so
            offset = loc.offset + first
            if file_sizes is not None and file_sizes.get(loc.file, offset + n * item) < offset + n * item:
                raise _NotSimple
            _append(out, loc.file, offset, n * item)
        elif encoding is _ZEROS:
            _append(out, None, 0, n * item)
        elif encoding is _INLINE:
            value = entry.attrs.get("value")
            if type(piece.region) is not Box or not isinstance(value, SmallTensor):
                raise _NotSimple
            _append(out, value.data, local * item, n * item)
        elif encoding is _REF:
            target = tensors.get(loc.file) if tensors is not None else None
            first = loc.offset + local
            if target is None or target.dtype != entry.dtype:
                raise _NotSimple
            if len(target.pieces) < _FEW and _few_raw(target, first, first + n, item, out, file_sizes):
                pos = hi
                k += 1
                continue
            if first + n > target.numel:
                raise _NotSimple
            table = _cached_runs(target, cache)
            if table is not None:  # flat runs meeting end to end: the tiling is exact
                _ranges(target, first, first + n, out, tensors, tiling, boxed, file_sizes, cache, table)
            else:
                tiling(target)
                inner = boxed(target, first, n)
                if inner is None:
                    raise _NotSimple
                for rel, off, nbytes in inner:
                    _append(out, rel, off, nbytes)
        else:
            raise _NotSimple  # an encoded item: decoded by the fetcher
        pos = hi
        k += 1
    return True


_FEW = 8  # a tensor of fewer pieces is swept without a remembered runs() table


def _few_raw(
    target: TensorEntry, start: int, end: int, item: int, out: list[ByteRange], file_sizes: Mapping[str, int] | None
) -> bool:
    """Append the ranges of [start, end) of a referenced tensor of few pieces in one pass over
    them (a ZeRO-3 parameter: its slices of the source ranks' buffers), where they are what the
    sweep reads most simply: flat runs in order tiling the tensor (runs()' in-order case), the
    read ones raw bytes inside their pieces and files. Else False with `out` as it was, and the
    general sweep (runs(), then _ranges) gives its answer, or its refusal, for the same range."""
    numel = target.numel
    if end > numel:
        return False
    mark = len(out)
    last = out[-1] if mark else None
    pos = 0
    for piece in target.pieces:
        region = piece.region
        if type(region) is not FlatRange:
            break
        lo, length = region.start, region.length
        if length <= 0:
            if length < 0 or lo < 0 or lo > numel:
                break
            continue
        if lo != pos:
            break
        pos = lo + length
        if pos > start and lo < end:
            loc = piece.location
            if _ENCODINGS.get(loc.encoding) is not _RAW:
                break
            a = start if start > lo else lo
            b = end if end < pos else pos
            first = (a - lo) * item
            nbytes = (b - a) * item
            if first + nbytes > loc.length:
                break
            offset = loc.offset + first
            if file_sizes is not None and file_sizes.get(loc.file, offset + nbytes) < offset + nbytes:
                break
            _append(out, loc.file, offset, nbytes)
    else:
        if pos == numel:
            return True
    del out[mark:]
    if mark:
        out[mark - 1] = last  # type: ignore[assignment]
    return False


def _cached_runs(entry: TensorEntry, cache: dict | None) -> tuple | None:
    """runs(entry), remembered for a stored tensor of many pieces that many references read (a
    one-use virtual tensor is not remembered)."""
    if cache is None or len(entry.pieces) < _FEW or entry.attrs.get("virtual"):
        return runs(entry)
    hit = cache.get(id(entry))
    if hit is not None and hit[0] is entry:
        return hit[1]
    table = runs(entry)
    if table is not None:
        cache[id(entry)] = (entry, table)
    return table


def _append(out: list[ByteRange], rel: "str | bytes | None", offset: int, nbytes: int) -> None:
    """Append a range, merged into the last one where it continues it in the same file."""
    if nbytes <= 0:
        return
    if out:
        prev_rel, prev_off, prev_n = out[-1]
        if (prev_rel is rel or (type(rel) is str and prev_rel == rel)) and (rel is None or prev_off + prev_n == offset):
            out[-1] = (prev_rel, prev_off, prev_n + nbytes)
            return
    out.append((rel, offset, nbytes))


def coalesce(ranges: list[ByteRange] | None) -> list[ByteRange] | None:
    """The same bytes as fewer ranges: empty ones dropped, each continuing the last in the same
    file (or the same bytes in memory, or zeros) merged into it."""
    if ranges is None:
        return None
    out: list[ByteRange] = []
    for rel, offset, nbytes in ranges:
        _append(out, rel, offset, nbytes)
    return out
