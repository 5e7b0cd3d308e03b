"""cover.py's grid test and sweep (coverage's check for many boxes) against counting every element:
exact where every element is covered once; otherwise the reported missing and doubled boxes are
exactly the elements covered zero and two or more times."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings, strategies as st

from ckptkit.index import cover, geometry
from ckptkit.index.types import Box


def _counts(shape, boxes):
    counts = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        counts[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))] += 1
    return counts


def _mask(shape, boxes):
    return _counts(shape, boxes) > 0


@st.composite
def _grid_layout(draw):
    """A product grid (rows, columns, blocks, N-d), then a few mistakes: a dropped, a repeated
    or a moved box, or none."""
    ndim = draw(st.integers(1, 4))
    shape, cuts = [], []
    for _ in range(ndim):
        n = draw(st.integers(1, 6))
        widths = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
        shape.append(sum(widths))
        cuts.append([sum(widths[:i]) for i in range(n + 1)])
    boxes = []

    def rec(d, offs, sizes):
        if d == ndim:
            boxes.append(Box(tuple(offs), tuple(sizes)))
            return
        for a, b in zip(cuts[d], cuts[d][1:]):
            rec(d + 1, offs + [a], sizes + [b - a])

    rec(0, [], [])
    return tuple(shape), _mistakes(draw, tuple(shape), boxes)


@st.composite
def _bands_layout(draw):
    """Rows cut into bands, each band cut into columns its own way (no product grid)."""
    rows, cols = draw(st.integers(1, 8)), draw(st.integers(1, 12))
    band_edges = sorted(set(draw(st.lists(st.integers(1, rows - 1), max_size=4)) if rows > 1 else []))
    bands = list(zip([0] + band_edges, band_edges + [rows]))
    boxes = []
    for a, b in bands:
        col_edges = sorted(set(draw(st.lists(st.integers(1, cols - 1), max_size=5)) if cols > 1 else []))
        for c, e in zip([0] + col_edges, col_edges + [cols]):
            boxes.append(Box((a, c), (b - a, e - c)))
    return (rows, cols), _mistakes(draw, (rows, cols), boxes)


def _mistakes(draw, shape, boxes):
    kind = draw(st.sampled_from(["none", "drop", "repeat", "move", "grow"]))
    if kind == "drop" and len(boxes) > 1:
        boxes.pop(draw(st.integers(0, len(boxes) - 1)))
    elif kind == "repeat":
        boxes.append(boxes[draw(st.integers(0, len(boxes) - 1))])
    elif kind in ("move", "grow"):
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        d = draw(st.integers(0, len(shape) - 1))
        if kind == "move" and b.offsets[d] > 0:
            boxes[i] = Box(b.offsets[:d] + (b.offsets[d] - 1,) + b.offsets[d + 1 :], b.sizes)
        elif kind == "grow" and b.offsets[d] + b.sizes[d] < shape[d]:
            boxes[i] = Box(b.offsets, b.sizes[:d] + (b.sizes[d] + 1,) + b.sizes[d + 1 :])
    return draw(st.permutations(boxes))


def _check(shape, boxes):
    spans = [(b.offsets, b.sizes) for b in boxes]
    counts = _counts(shape, boxes)
    swept = cover.Sweep(shape, max_report=10**9).run(spans)
    missing = [Box(o, s) for o, s in swept.missing]
    doubled = [Box(o, s) for o, s in swept.doubled]
    assert np.array_equal(_counts(shape, missing), (counts == 0).astype(np.int64)), (shape, boxes, missing)
    assert np.array_equal(_mask(shape, doubled), counts >= 2), (shape, boxes, doubled)
    assert swept.missing_elements == int((counts == 0).sum())
    if cover.is_grid_tiling(shape, spans):
        assert np.all(counts == 1)
    # and the pairwise check (few boxes) agrees on the verdict and the missing count
    few = geometry._coverage_pairwise(shape, boxes, 16, geometry.Coverage())
    assert few.exact == (not missing and not doubled)
    assert few.missing_elements == swept.missing_elements


@settings(max_examples=300, deadline=None)
@given(_grid_layout())
def test_sweep_finds_exactly_the_missing_and_doubled_elements_of_grids(args):
    _check(*args)


@settings(max_examples=300, deadline=None)
@given(_bands_layout())
def test_sweep_finds_exactly_the_missing_and_doubled_elements_of_bands(args):
    _check(*args)


def test_grid_test_refuses_what_is_no_single_cell_per_box():
    shape = (4, 4)
    halves = [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    assert cover.is_grid_tiling(shape, halves)
    assert not cover.is_grid_tiling(shape, halves[:1] + [((0, 0), (2, 4))])  # one half twice
    assert not cover.is_grid_tiling(shape, [((0, 0), (4, 4)), ((0, 0), (2, 2))])  # a cell and its part
    bands = [((0, 0), (2, 1)), ((0, 1), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 1))]
    assert not cover.is_grid_tiling(shape, bands)  # exact, but no product grid: the sweep decides
    assert cover.Sweep(shape, 16).run(bands).missing_elements == 0
    assert math.prod(shape) == sum(math.prod(s) for _, s in bands)
