"""Which pieces of a tensor meet a box, without visiting every piece.

Planning a read used to intersect the box with every piece: consolidate and verify --deep plan one
box per slab, so a tensor of n pieces read in m slabs cost n * m intersections (16,000 side-by-side
chunks ran for minutes). Here each dimension keeps the pieces' boxes sorted by offset; a box's
candidates along a dimension are those starting in [box start - widest piece, box end), found by
two bisections, and the dimension with the fewest candidates is the one filtered exactly.
"""

from __future__ import annotations

from bisect import bisect_left

from ..index import geometry
from ..index.types import Box, TensorEntry

Part = tuple[int, int, Box, int]  # (piece index, run index within the piece, box, element offset)


class PieceLookup:
    """The boxes of an entry's pieces (a flat piece as its row-major runs), indexed per dimension."""

    def __init__(self, entry: TensorEntry) -> None:
        parts: list[Part] = []
        for i, piece in enumerate(entry.pieces):
            region = piece.region
            runs = ((region, 0),) if type(region) is Box else geometry.flat_to_boxes(region, entry.shape)
            for j, (sub, elem_offset) in enumerate(runs):
                parts.append((i, j, sub, elem_offset))
        self.parts = parts
        self.ndim = len(entry.shape)
        self.order: list[list[int]] = []  # per dimension: part numbers by offset
        self.starts: list[list[int]] = []  # per dimension: those offsets, sorted
        self.widest: list[int] = []  # per dimension: the largest size of any part
        for d in range(self.ndim):
            order = sorted(range(len(parts)), key=lambda k: parts[k][2].offsets[d])
            self.order.append(order)
            self.starts.append([parts[k][2].offsets[d] for k in order])
            self.widest.append(max((p[2].sizes[d] for p in parts), default=0))

    @staticmethod
    def of(entry: TensorEntry) -> "PieceLookup | None":
        """The lookup of an entry, or None where a piece's box has another rank than the tensor
        (intersecting it is an error the caller's own loop raises)."""
        rank = len(entry.shape)
        if any(type(p.region) is Box and p.region.ndim != rank for p in entry.pieces):
            return None
        return PieceLookup(entry)

    def meeting(self, box: Box) -> list[Part]:
        """The parts that may meet `box` (a superset: the caller intersects), in piece order."""
        if self.ndim == 0 or box.ndim != self.ndim:
            return list(self.parts)
        best: tuple[int, int, int] | None = None
        for d in range(self.ndim):
            lo = bisect_left(self.starts[d], box.offsets[d] - self.widest[d] + 1)
            hi = bisect_left(self.starts[d], box.offsets[d] + box.sizes[d])
            if best is None or hi - lo < best[2] - best[1]:
                best = (d, lo, hi)
        d, lo, hi = best
        found = sorted(self.order[d][lo:hi])
        return [self.parts[k] for k in found]
