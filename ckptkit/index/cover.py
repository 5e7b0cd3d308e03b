"""Exact-cover checks over many boxes in O(n log n): a grid test, then a recursive sweep.

geometry.coverage's pairwise sweep along dim 0 is quadratic where many boxes share rows (a tensor
stored as thousands of side-by-side column chunks, or 2-D blocks), and its subtraction of every box
from the tensor grows with fragments. Here:

- a grid tiling (each dimension cut at a set of points, one box per cell: rows, columns, 2-D and
  N-d blocks) is recognised by hashing offsets against the per-dimension cut points, O(n * ndim);
- anything else goes through a sweep: the dimension whose slabs cost least is swept, each slab
  between two consecutive box edges holds the boxes active across it, and the slab is swept again
  along the next dimension with only those boxes. An empty slab is missing, a slab of the last
  dimension with two or more boxes is doubled. The work is the sum, over slabs, of the boxes active
  in them: O(n log n) for tilings whose boxes do not reach across many slabs of another box's
  sweep (every grid, bands of differently cut rows, mixed column/row groups), and bounded by
  n * slabs for the rest.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right

Span = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of an in-bounds, non-empty box


def is_grid_tiling(shape: tuple[int, ...], boxes: list[Span]) -> bool:
    """Whether the boxes are exactly the cells of one product grid over `shape` (each cell once).

    Sufficient for an exact cover: every box is one cell between consecutive cut points, no two
    boxes start at the same corner, and there are as many boxes as cells."""
    ndim = len(shape)
    cuts = []
    for d in range(ndim):
        points = {0, shape[d]}
        for offs, sizes in boxes:
            points.add(offs[d])
            points.add(offs[d] + sizes[d])
        cuts.append(sorted(points))
    if math.prod(len(c) - 1 for c in cuts) != len(boxes):
        return False
    position = [{x: i for i, x in enumerate(c)} for c in cuts]
    corners = set()
    for offs, sizes in boxes:
        for d in range(ndim):
            if position[d][offs[d] + sizes[d]] != position[d][offs[d]] + 1:
                return False
        corners.add(offs)
    return len(corners) == len(boxes)


class Sweep:
    """The missing and doubled parts of `shape` under boxes, as boxes (the first `max_report` of
    each kept), and the count of missing elements."""

    def __init__(self, shape: tuple[int, ...], max_report: int) -> None:
        self.shape = tuple(shape)
        self.max_report = max_report
        self.missing: list[Span] = []
        self.doubled: list[Span] = []
        self.missing_elements = 0

    def run(self, boxes: list[Span]) -> "Sweep":
        ndim = len(self.shape)
        self._slab(boxes, tuple(range(ndim)), tuple(0 for _ in self.shape), self.shape)
        return self

    def _slab(self, boxes: list[Span], dims: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
        """Sweep the region [lo, hi) in which every box spans the dimensions not in `dims`."""
        if not boxes:
            self._missing(lo, hi)
            return
        if len(boxes) == 1:  # the box's part of the region, and the rest missing
            offs, sizes = boxes[0]
            inner = _clip(offs, sizes, lo, hi)
            if inner != (lo, hi):
                self._subtract_one(lo, hi, inner)
            return
        d = _cheapest(boxes, dims) if len(dims) > 1 else dims[0]
        rest = tuple(x for x in dims if x != d)
        edges = sorted(
            {lo[d], hi[d]}
            | {max(lo[d], min(hi[d], o[d])) for o, _ in boxes}
            | {max(lo[d], min(hi[d], o[d] + s[d])) for o, s in boxes}
        )
        starts = sorted(range(len(boxes)), key=lambda i: boxes[i][0][d])
        ends = sorted(range(len(boxes)), key=lambda i: boxes[i][0][d] + boxes[i][1][d])
        active: dict[int, Span] = {}
        si = ei = 0
        for x0, x1 in zip(edges, edges[1:]):
            while ei < len(ends) and boxes[ends[ei]][0][d] + boxes[ends[ei]][1][d] <= x0:
                active.pop(ends[ei], None)
                ei += 1
            while si < len(starts) and boxes[starts[si]][0][d] <= x0:
                i = starts[si]
                if boxes[i][0][d] + boxes[i][1][d] > x0:
                    active[i] = boxes[i]
                si += 1
            slab_lo, slab_hi = _with(lo, d, x0), _with(hi, d, x1)
            if not rest:
                if not active:
                    self._missing(slab_lo, slab_hi)
                elif len(active) > 1:
                    self._doubled(slab_lo, slab_hi)
            else:
                self._slab(list(active.values()), rest, slab_lo, slab_hi)

    def _subtract_one(self, lo: tuple[int, ...], hi: tuple[int, ...], inner: tuple) -> None:
        """[lo, hi) minus one box inside it, as at most 2 * ndim missing boxes."""
        ilo, ihi = inner
        cur_lo, cur_hi = list(lo), list(hi)
        for d in range(len(lo)):
            if ilo[d] > cur_lo[d]:
                self._missing(tuple(cur_lo), tuple(cur_hi[:d] + [ilo[d]] + cur_hi[d + 1 :]))
            if ihi[d] < cur_hi[d]:
                self._missing(tuple(cur_lo[:d] + [ihi[d]] + cur_lo[d + 1 :]), tuple(cur_hi))
            cur_lo[d], cur_hi[d] = ilo[d], ihi[d]

    def _missing(self, lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
        n = math.prod(h - l_ for l_, h in zip(lo, hi))
        if n <= 0:
            return
        self.missing_elements += n
        if len(self.missing) < self.max_report:
            self.missing.append((lo, tuple(h - l_ for l_, h in zip(lo, hi))))

    def _doubled(self, lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
        if len(self.doubled) < self.max_report and all(h > l_ for l_, h in zip(lo, hi)):
            self.doubled.append((lo, tuple(h - l_ for l_, h in zip(lo, hi))))


def _cheapest(boxes: list[Span], dims: tuple[int, ...]) -> int:
    """The dimension whose sweep carries the fewest boxes across slabs: each box counts once per
    slab (between consecutive distinct edges) it spans."""
    best, best_cost = dims[0], None
    for d in dims:
        edges = sorted({o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes})
        cost = 0
        for o, s in boxes:
            cost += bisect_left(edges, o[d] + s[d]) - bisect_right(edges, o[d]) + 1
        if best_cost is None or cost < best_cost:
            best, best_cost = d, cost
    return best


def _clip(offs: tuple[int, ...], sizes: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]) -> tuple:
    return (tuple(max(o, l_) for o, l_ in zip(offs, lo)), tuple(min(o + s, h) for o, s, h in zip(offs, sizes, hi)))


def _with(t: tuple[int, ...], d: int, x: int) -> tuple[int, ...]:
    return t[:d] + (x,) + t[d + 1 :]
