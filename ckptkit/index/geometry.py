"""Pure geometry over tensor regions: intersections, flat-range decomposition, coverage.

Everything reduces to boxes: a range of the row-major flattening decomposes into at most
2*ndim+1 boxes, each of which is itself contiguous in that flattening. So the planner and the
coverage check only ever intersect boxes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import cover
from .strides import row_major_strides as row_major_strides  # re-exported: the planner asks geometry
from .strides import strided_span
from .types import Box, FlatRange, Region


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when it holds no element."""
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect boxes of rank {a.ndim} and {b.ndim}")
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    if a.numel == 0 or b.numel == 0:
        return None
    return Box(tuple(offsets), tuple(sizes))


def contains(outer: Box, inner: Box) -> bool:
    return all(
        o <= i and i + s <= o + os_ for o, os_, i, s in zip(outer.offsets, outer.sizes, inner.offsets, inner.sizes)
    )


def flat_to_boxes(fr: FlatRange, shape: tuple[int, ...]) -> list[tuple[Box, int]]:
    """Decompose a flat range into boxes, each paired with its element offset inside the range.

    Every returned box is contiguous in the row-major flattening, so its elements are stored
    consecutively in the range's bytes starting at the paired offset.
    """
    out: list[tuple[Box, int]] = []
    if fr.length <= 0:
        return out
    if len(shape) == 0:
        return [(Box((), ()), 0)] if fr.start == 0 and fr.length >= 1 else []
    if len(shape) == 1:  # (a flat buffer, a bias: the range is its own box)
        return [(Box((fr.start,), (fr.length,)), 0)]

    def rec(start: int, end: int, dims: tuple[int, ...], prefix: tuple[int, ...]) -> None:
        # [start, end) are flat positions inside the sub-tensor of shape `dims` at index `prefix`
        if start >= end:
            return
        inner = math.prod(dims[1:])
        if len(dims) == 1:
            out.append((_box(prefix, (start,), (end - start,), shape), 0))
            return
        first_row, last_row = start // inner, (end - 1) // inner
        if start % inner == 0 and end % inner == 0:
            out.append(
                (_box(prefix, (first_row,) + (0,) * (len(dims) - 1), (last_row - first_row + 1,) + dims[1:], shape), 0)
            )
            return
        if first_row == last_row:
            rec(start - first_row * inner, end - first_row * inner, dims[1:], prefix + (first_row,))
            return
        head_end = (first_row + 1) * inner
        rec(start - first_row * inner, inner, dims[1:], prefix + (first_row,))
        mid_lo, mid_hi = first_row + 1, end // inner
        if mid_hi > mid_lo:
            out.append((_box(prefix, (mid_lo,) + (0,) * (len(dims) - 1), (mid_hi - mid_lo,) + dims[1:], shape), 0))
        tail_start = max(head_end, mid_hi * inner)
        if end > tail_start:
            rec(0, end - tail_start, dims[1:], prefix + (end // inner,))

    rec(fr.start, fr.end, tuple(shape), ())
    # attach each box's offset within the range: boxes come out in row-major order
    result, pos = [], 0
    for box, _ in out:
        result.append((box, pos))
        pos += box.numel
    return result


def _box(prefix: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    return Box(prefix + offsets, (1,) * len(prefix) + sizes)


def region_boxes(region: Region, shape: tuple[int, ...]) -> list[tuple[Box, int]]:
    """Boxes making up a region, each with the element offset of its first element in the piece.

    For a Box region the offset is 0 and the piece's own strides apply; for a FlatRange the
    boxes are consecutive runs of the piece's contiguous data.
    """
    if isinstance(region, Box):
        return [(region, 0)]
    return flat_to_boxes(region, shape)


def in_bounds(region: Region, shape: tuple[int, ...]) -> bool:
    if isinstance(region, FlatRange):
        return region.start >= 0 and region.length >= 0 and region.end <= math.prod(shape)
    if region.ndim != len(shape):
        return False
    return all(o >= 0 and s >= 0 and o + s <= d for o, s, d in zip(region.offsets, region.sizes, shape))


def subtract(a: Box, b: Box) -> list[Box]:
    """a minus b as disjoint boxes (at most 2*ndim of them)."""
    inter = intersect(a, b)
    if inter is None:
        return [a] if a.numel else []
    pieces: list[Box] = []
    offs, sizes = list(a.offsets), list(a.sizes)
    for d in range(a.ndim):
        lo, hi = inter.offsets[d], inter.offsets[d] + inter.sizes[d]
        if lo > offs[d]:
            pieces.append(
                Box(tuple(offs[:d] + [offs[d]] + offs[d + 1 :]), tuple(sizes[:d] + [lo - offs[d]] + sizes[d + 1 :]))
            )
        end = offs[d] + sizes[d]
        if hi < end:
            pieces.append(Box(tuple(offs[:d] + [hi] + offs[d + 1 :]), tuple(sizes[:d] + [end - hi] + sizes[d + 1 :])))
        offs[d], sizes[d] = lo, hi - lo
    return pieces


@dataclass
class Coverage:
    """How a tensor's pieces cover it: exact when nothing is missing, doubled or out of bounds."""

    missing: list[Box] = field(default_factory=list)
    doubled: list[Box] = field(default_factory=list)
    out_of_bounds: list[Region] = field(default_factory=list)
    missing_elements: int = 0

    @property
    def exact(self) -> bool:
        return not (self.missing or self.doubled or self.out_of_bounds)


# Up to this many boxes the pairwise check below runs (its examples are the ones users have
# seen); past it, cover.py's grid test and sweep, O(n log n) in every layout.
_PAIRWISE_BOXES = 256


def coverage(shape: tuple[int, ...], regions: list[Region], max_report: int = 16) -> Coverage:
    """Check that the regions cover every element of a tensor of `shape` exactly once."""
    if _tiles_end_to_end(tuple(shape), regions):
        return Coverage()
    return _coverage_by_boxes(shape, regions, max_report)


def _coverage_by_boxes(shape: tuple[int, ...], regions: list[Region], max_report: int) -> Coverage:
    """coverage without its shortcut: every region as boxes, checked pairwise or swept."""
    cov = Coverage()
    boxes: list[Box] = []
    for region in regions:
        if not in_bounds(region, shape):
            cov.out_of_bounds.append(region)
            continue
        boxes.extend(b for b, _ in region_boxes(region, shape) if b.numel)
    if len(boxes) <= _PAIRWISE_BOXES or not shape:
        return _coverage_pairwise(shape, boxes, max_report, cov)
    return _coverage_swept(tuple(shape), boxes, max_report, cov)


def _coverage_swept(shape: tuple[int, ...], boxes: list[Box], max_report: int, cov: Coverage) -> Coverage:
    """coverage for many boxes: a grid tiling is exact at once, the rest is swept (cover.py)."""
    spans = [(b.offsets, b.sizes) for b in boxes]
    if cover.is_grid_tiling(shape, spans):
        return cov
    swept = cover.Sweep(shape, max_report).run(spans)
    cov.missing = [Box(o, s) for o, s in swept.missing]
    cov.doubled = [Box(o, s) for o, s in swept.doubled]
    cov.missing_elements = swept.missing_elements
    return cov


def _coverage_pairwise(shape: tuple[int, ...], boxes: list[Box], max_report: int, cov: Coverage) -> Coverage:
    """coverage for few boxes: doubles found pairwise along dim 0, the tensor minus every box
    left as what is missing."""
    # doubled: sweep along dim 0 so disjoint row bands are never compared
    if boxes and boxes[0].ndim:
        order = sorted(boxes, key=lambda b: b.offsets[0])
        for i, a in enumerate(order):
            a_end = a.offsets[0] + a.sizes[0]
            for b in order[i + 1 :]:
                if b.offsets[0] >= a_end:
                    break
                inter = intersect(a, b)
                if inter is not None and len(cov.doubled) < max_report:
                    cov.doubled.append(inter)
    elif len(boxes) > 1:
        cov.doubled.append(Box((), ()))
    # missing: the whole tensor minus every box
    remaining = [Box.whole(tuple(shape))] if math.prod(shape) else []
    for b in boxes:
        nxt: list[Box] = []
        for r in remaining:
            nxt.extend(subtract(r, b))
        remaining = nxt
        if not remaining:
            break
    cov.missing_elements = sum(r.numel for r in remaining)
    cov.missing = remaining[:max_report]
    return cov


def _tiles_end_to_end(shape: tuple[int, ...], regions: list[Region]) -> bool:
    """The common exact tilings, known without boxes: one region that is the whole tensor (every
    item a writer streams), none for an empty tensor (DeepSpeed's placeholders), or flat regions
    meeting end to end over [0, numel) (ZeRO partitions). False is no verdict: coverage decides."""
    numel = math.prod(shape)
    if len(regions) == 1 and type(regions[0]) is Box:
        return regions[0] == Box.whole(shape)
    runs = []
    for region in regions:
        if type(region) is not FlatRange or region.length < 0:
            return False
        runs.append((region.start, region.length))
    pos = 0
    for start, length in sorted(runs):
        if start != pos:
            return False
        pos += length
    return pos == numel


def split_rowmajor(box: Box, max_elems: int) -> Iterator[Box]:
    """Split a box into sub-boxes, in order, each contiguous in the box's row-major layout.

    Used to stream a large target region in slabs that fit the memory budget while still
    writing the output sequentially. A generator: the slabs of a tensor whose shape a file
    declares are never held as one list (a [2**62, 4] tensor would need 2**62 of them).
    """
    max_elems = max(1, max_elems)
    if box.numel <= max_elems or box.ndim == 0:
        yield box
        return
    inner = math.prod(box.sizes[1:])
    if inner <= max_elems:
        rows = max(1, max_elems // max(inner, 1))
        for r in range(0, box.sizes[0], rows):
            n = min(rows, box.sizes[0] - r)
            yield Box((box.offsets[0] + r,) + box.offsets[1:], (n,) + box.sizes[1:])
        return
    row = Box(box.offsets[1:], box.sizes[1:])
    for r in range(box.sizes[0]):
        for sub in split_rowmajor(row, max_elems):
            yield Box((box.offsets[0] + r,) + sub.offsets, (1,) + sub.sizes)


def split_by_span(box: Box, strides: tuple[int, ...], max_span: int) -> Iterator[Box]:
    """Split a box of a strided view into sub-boxes, in row-major order, whose strided span (the
    elements from a sub-box's first to its last, holes included) is at most `max_span`: each
    is then one bounded read of the storage. A lone element is never split further."""
    max_span = max(1, max_span)
    if box.ndim == 0 or box.numel == 0 or strided_span(box.sizes, strides) <= max_span:
        yield box
        return
    rest_sizes, rest_strides = box.sizes[1:], strides[1:]
    rest = strided_span(rest_sizes, rest_strides) if rest_sizes else 1
    if rest <= max_span:
        rows = max(1, (max_span - rest) // strides[0] + 1) if strides[0] else box.sizes[0]
        for r in range(0, box.sizes[0], rows):
            n = min(rows, box.sizes[0] - r)
            yield Box((box.offsets[0] + r,) + box.offsets[1:], (n,) + rest_sizes)
        return
    row = Box(box.offsets[1:], rest_sizes)
    for r in range(box.sizes[0]):
        for sub in split_by_span(row, rest_strides, max_span):
            yield Box((box.offsets[0] + r,) + sub.offsets, (1,) + sub.sizes)
