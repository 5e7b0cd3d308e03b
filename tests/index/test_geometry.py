"""Property tests for ckptkit.index.geometry and layouts.chunk_dim0.

Every property is checked against a brute-force ground truth: the tensor's elements are
numbered 0..numel-1 in row-major order (``np.arange(numel).reshape(shape)``), a box selects
``arr[slices]`` and a flat range selects ``arange(start, end)``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ckptkit.index.geometry import (
    contains,
    coverage,
    flat_to_boxes,
    in_bounds,
    intersect,
    region_boxes,
    row_major_strides,
    split_rowmajor,
    subtract,
)
from ckptkit.index.layouts import Assignment, chunk_dim0
from ckptkit.index.types import Box, FlatRange

FAST = settings(max_examples=150, deadline=None)
MEDIUM = settings(max_examples=80, deadline=None)


# ---------------------------------------------------------------------------------------------
# ground truth helpers


def numbered(shape):
    return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)


def idx(box: Box):
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def box_elems(arr: np.ndarray, box: Box) -> np.ndarray:
    """The flat ids of a box's elements, in the box's own row-major order."""
    return np.asarray(arr[idx(box)]).reshape(-1)


def region_elems(arr: np.ndarray, region) -> np.ndarray:
    if isinstance(region, FlatRange):
        return np.arange(region.start, region.end, dtype=np.int64)
    return box_elems(arr, region)


def mask_of(shape, box: Box) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[idx(box)] = True
    return m


def counts_of(shape, boxes) -> np.ndarray:
    c = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        c[idx(b)] += 1
    return c


def region_counts(shape, regions) -> np.ndarray:
    c = np.zeros(math.prod(shape), dtype=np.int64)
    arr = numbered(shape)
    for r in regions:
        np.add.at(c, region_elems(arr, r), 1)
    return c.reshape(shape)


# ---------------------------------------------------------------------------------------------
# strategies

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple)
ranked_shapes = st.lists(st.integers(0, 6), min_size=1, max_size=4).map(tuple)


@st.composite
def box_in(draw, shape):
    """A box inside `shape` (possibly with zero-size dims)."""
    offs, sizes = [], []
    for d in shape:
        o = draw(st.integers(0, d))
        s = draw(st.integers(0, d - o))
        offs.append(o)
        sizes.append(s)
    return Box(tuple(offs), tuple(sizes))


@st.composite
def shape_and_boxes(draw, n=2):
    shape = draw(shapes)
    return (shape,) + tuple(draw(box_in(shape)) for _ in range(n))


@st.composite
def guillotine(draw, shape, max_splits=10):
    """A random partition of Box.whole(shape) into boxes by repeated axis-aligned cuts."""
    boxes = [Box.whole(shape)]
    for _ in range(draw(st.integers(0, max_splits))):
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        dims = [d for d in range(b.ndim) if b.sizes[d] >= 2]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        c = draw(st.integers(1, b.sizes[d] - 1))
        lo = Box(b.offsets, b.sizes[:d] + (c,) + b.sizes[d + 1 :])
        hi = Box(
            b.offsets[:d] + (b.offsets[d] + c,) + b.offsets[d + 1 :], b.sizes[:d] + (b.sizes[d] - c,) + b.sizes[d + 1 :]
        )
        boxes[i : i + 1] = [lo, hi]
    return boxes


@st.composite
def flat_partition(draw, numel, start=0, max_cuts=8):
    """Random sorted cut points over [start, start+numel): ZeRO-style flat ranges (some may be empty)."""
    cuts = sorted(draw(st.lists(st.integers(start, start + numel), max_size=max_cuts)))
    bounds = [start] + cuts + [start + numel]
    return [FlatRange(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _as_flat_if_contiguous(arr, box: Box):
    e = box_elems(arr, box)
    if e.size and np.all(np.diff(e) == 1):
        return FlatRange(int(e[0]), int(e.size))
    return None


@st.composite
def mixed_layout(draw, shape):
    """Bands along dim 0; each band is one flat range, a flat partition, or a box partition
    whose flat-contiguous boxes are randomly rewritten as flat ranges."""
    if len(shape) == 0:
        base = [draw(st.sampled_from([Box((), ()), FlatRange(0, 1)]))]
        extra = draw(st.lists(st.sampled_from([FlatRange(0, 0), FlatRange(1, 0)]), max_size=2))
        return base + extra
    arr = numbered(shape)
    inner = math.prod(shape[1:])
    rows = sorted(draw(st.lists(st.integers(0, shape[0]), max_size=3)))
    bands = [0] + rows + [shape[0]]
    regions = []
    for r0, r1 in zip(bands, bands[1:]):
        mode = draw(st.sampled_from(["flat", "flatsplit", "boxes"]))
        if mode == "flat" or r1 == r0:
            regions.append(FlatRange(r0 * inner, (r1 - r0) * inner))
        elif mode == "flatsplit":
            regions.extend(draw(flat_partition((r1 - r0) * inner, start=r0 * inner, max_cuts=4)))
        else:
            for b in draw(guillotine((r1 - r0,) + tuple(shape[1:]), max_splits=5)):
                b = Box((b.offsets[0] + r0,) + b.offsets[1:], b.sizes)
                fr = _as_flat_if_contiguous(arr, b)
                regions.append(fr if fr is not None and draw(st.booleans()) else b)
    return regions


@st.composite
def shape_and_layout(draw):
    kind = draw(st.sampled_from(["chunk", "flat", "mixed", "guillotine"]))
    if kind == "chunk":
        shape = draw(ranked_shapes)
        return kind, shape, list(chunk_dim0(shape, draw(st.integers(1, 8))))
    shape = draw(shapes)
    if kind == "flat":
        return kind, shape, draw(flat_partition(math.prod(shape)))
    if kind == "guillotine":
        return kind, shape, draw(guillotine(shape))
    return kind, shape, draw(mixed_layout(shape))


# ---------------------------------------------------------------------------------------------
# intersect


@FAST
@given(shape_and_boxes())
def test_intersect_is_set_intersection(args):
    shape, a, b = args
    want = mask_of(shape, a) & mask_of(shape, b)
    got = intersect(a, b)
    if not want.any():
        assert got is None
    else:
        assert got is not None and got.numel > 0
        assert np.array_equal(mask_of(shape, got), want)
    # symmetric
    assert intersect(b, a) == got


@FAST
@given(shapes, st.data())
def test_intersect_with_self_and_whole(shape, data):
    a = data.draw(box_in(shape))
    whole = Box.whole(shape)
    expect = a if a.numel else None
    assert intersect(a, a) == expect
    assert intersect(a, whole) == expect


def test_intersect_examples():
    assert intersect(Box((), ()), Box((), ())) == Box((), ())
    assert intersect(Box((0,), (3,)), Box((3,), (2,))) is None  # touching, not overlapping
    assert intersect(Box((0, 0), (0, 5)), Box((0, 0), (4, 5))) is None  # zero-size box
    assert intersect(Box((1, 2), (3, 3)), Box((2, 0), (5, 4))) == Box((2, 2), (2, 2))
    with pytest.raises(ValueError):
        intersect(Box((0,), (1,)), Box((0, 0), (1, 1)))


# ---------------------------------------------------------------------------------------------
# flat_to_boxes


@st.composite
def shape_and_flat_range(draw):
    shape = draw(shapes)
    numel = math.prod(shape)
    s = draw(st.integers(0, numel))
    n = draw(st.integers(0, numel - s))
    return shape, FlatRange(s, n)


def _check_flat_decomposition(shape, fr, pairs):
    arr = numbered(shape)
    got = []
    for box, off in pairs:
        assert in_bounds(box, shape), (box, shape)
        assert box.numel > 0
        e = box_elems(arr, box)
        # contiguous in the row-major flattening
        assert np.array_equal(e, np.arange(e[0], e[0] + e.size)), box
        # the paired offset is where the box's first element sits inside the range
        assert off == e[0] - fr.start, (box, off)
        assert off == len(got)
        got.extend(e.tolist())
    assert got == list(range(fr.start, fr.end))
    # disjoint and union exactly the range
    c = counts_of(shape, [b for b, _ in pairs]).reshape(-1)
    want = np.zeros(math.prod(shape), dtype=np.int64)
    want[fr.start : fr.end] = 1
    assert np.array_equal(c, want)
    assert len(pairs) <= 2 * len(shape) + 1


@settings(max_examples=300, deadline=None)
@given(shape_and_flat_range())
def test_flat_to_boxes_properties(args):
    shape, fr = args
    pairs = flat_to_boxes(fr, shape)
    _check_flat_decomposition(shape, fr, pairs)
    assert region_boxes(fr, shape) == pairs


def test_flat_to_boxes_exhaustive_small():
    for shape in [(), (1,), (5,), (2, 3), (3, 1, 4), (2, 3, 2, 2), (1, 1, 3), (4, 1)]:
        numel = math.prod(shape)
        for s in range(numel + 1):
            for n in range(numel - s + 1):
                fr = FlatRange(s, n)
                _check_flat_decomposition(shape, fr, flat_to_boxes(fr, shape))


def test_region_boxes_of_box_is_itself():
    b = Box((1, 0), (2, 3))
    assert region_boxes(b, (4, 3)) == [(b, 0)]


# ---------------------------------------------------------------------------------------------
# subtract


@FAST
@given(shape_and_boxes())
def test_subtract_is_set_difference(args):
    shape, a, b = args
    parts = subtract(a, b)
    want = mask_of(shape, a) & ~mask_of(shape, b)
    c = counts_of(shape, parts)
    assert c.max(initial=0) <= 1, "pieces overlap"
    assert np.array_equal(c == 1, want)
    for p in parts:
        assert contains(a, p)
    assert len(parts) <= 2 * len(shape)


def test_subtract_examples():
    a = Box((0, 0), (4, 4))
    assert subtract(a, a) == []
    assert subtract(a, Box((10, 10), (1, 1))) == [a]
    assert subtract(Box((0, 0), (0, 4)), Box((0, 0), (1, 1))) == []
    parts = subtract(a, Box((1, 1), (2, 2)))
    assert sum(p.numel for p in parts) == 12


# ---------------------------------------------------------------------------------------------
# coverage


@MEDIUM
@given(shape_and_layout())
def test_coverage_exact_for_partitions(args):
    kind, shape, regions = args
    # ground truth: the generated layout really is a partition
    assert np.all(region_counts(shape, regions) == 1)
    cov = coverage(shape, regions)
    assert cov.exact, (kind, shape, regions, cov)
    assert cov.missing_elements == 0
    assert cov.missing == [] and cov.doubled == [] and cov.out_of_bounds == []


@MEDIUM
@given(shape_and_layout(), st.data())
def test_coverage_reports_dropped_piece(args, data):
    kind, shape, regions = args
    i = data.draw(st.integers(0, len(regions) - 1))
    dropped = regions[i]
    rest = regions[:i] + regions[i + 1 :]
    cov = coverage(shape, rest, max_report=10_000)
    assert cov.missing_elements == dropped.numel
    assert cov.doubled == [] and cov.out_of_bounds == []
    assert cov.exact == (dropped.numel == 0)
    # the missing boxes are exactly the dropped piece's elements
    arr = numbered(shape)
    missing = counts_of(shape, cov.missing).reshape(-1)
    want = np.zeros(math.prod(shape), dtype=np.int64)
    want[region_elems(arr, dropped)] = 1
    assert np.array_equal(missing, want)


@MEDIUM
@given(shape_and_layout(), st.data())
def test_coverage_reports_duplicated_piece(args, data):
    kind, shape, regions = args
    nonempty = [r for r in regions if r.numel]
    assume(nonempty)
    dup = data.draw(st.sampled_from(nonempty))
    pos = data.draw(st.integers(0, len(regions)))
    cov = coverage(shape, regions[:pos] + [dup] + regions[pos:], max_report=10_000)
    assert not cov.exact
    assert cov.doubled, (kind, shape, regions, dup)
    assert cov.missing_elements == 0 and cov.out_of_bounds == []
    # every reported doubled box lies inside the duplicated piece
    dup_mask = np.zeros(math.prod(shape), dtype=bool)
    dup_mask[region_elems(numbered(shape), dup)] = True
    for d in cov.doubled:
        assert np.all(dup_mask.reshape(shape)[idx(d)])
    # and together they cover it
    assert np.array_equal(counts_of(shape, cov.doubled).reshape(-1) > 0, dup_mask)


@MEDIUM
@given(shape_and_layout(), st.data())
def test_coverage_reports_out_of_bounds(args, data):
    kind, shape, regions = args
    numel = math.prod(shape)
    candidates = [
        FlatRange(numel, 1),
        FlatRange(0, numel + 1),
        FlatRange(-1, 1),
        Box((0,) * (len(shape) + 1), (1,) * (len(shape) + 1)),
    ]
    if shape:
        candidates += [
            Box((shape[0],) + (0,) * (len(shape) - 1), (1,) + tuple(shape[1:])),
            Box((-1,) + (0,) * (len(shape) - 1), (1,) * len(shape)),
            Box((0,) * len(shape), tuple(d + 1 for d in shape)),
            Box((0,) * (len(shape) - 1), (1,) * (len(shape) - 1)),
        ]
    bad = data.draw(st.sampled_from(candidates))
    assert not in_bounds(bad, shape)
    pos = data.draw(st.integers(0, len(regions)))
    cov = coverage(shape, regions[:pos] + [bad] + regions[pos:])
    assert bad in cov.out_of_bounds
    assert not cov.exact


def test_coverage_examples():
    assert coverage((4,), [Box((0,), (2,)), Box((2,), (2,))]).exact
    assert coverage((), [Box((), ())]).exact
    assert coverage((), [FlatRange(0, 1)]).exact
    assert coverage((), []).missing_elements == 1
    assert coverage((), [Box((), ()), FlatRange(0, 1)]).doubled
    assert coverage((0, 3), []).exact
    cov = coverage((2, 3), [FlatRange(0, 4)])
    assert cov.missing_elements == 2 and not cov.exact
    cov = coverage((2, 3), [FlatRange(0, 4), Box((1, 0), (1, 3))])
    assert cov.doubled and cov.missing_elements == 0


# ---------------------------------------------------------------------------------------------
# split_rowmajor


@FAST
@given(shapes, st.data())
def test_split_rowmajor(shape, data):
    box = data.draw(box_in(shape))
    max_elems = data.draw(st.integers(-1, box.numel + 3))
    subs = list(split_rowmajor(box, max_elems))  # a generator
    arr = numbered(shape)
    # concatenating the sub-boxes' elements in order gives the box's elements in row-major
    # order: disjoint, union == box, consecutive and each contiguous in the box's layout
    got = np.concatenate([box_elems(arr, s) for s in subs]) if subs else np.array([], np.int64)
    assert np.array_equal(got, box_elems(arr, box))
    box_arr = np.arange(box.numel).reshape(box.sizes)  # positions in the box's own layout
    pos = 0
    for s in subs:
        assert contains(box, s)
        local = Box(tuple(o - bo for o, bo in zip(s.offsets, box.offsets)), s.sizes)
        e = box_elems(box_arr, local)
        assert np.array_equal(e, np.arange(pos, pos + s.numel))
        pos += s.numel
        if box.numel:
            assert 1 <= s.numel <= max(1, max_elems)
    assert pos == box.numel


def test_split_rowmajor_examples():
    b = Box((1, 2), (3, 4))
    assert list(split_rowmajor(b, 100)) == [b]
    assert list(split_rowmajor(b, 8)) == [Box((1, 2), (2, 4)), Box((3, 2), (1, 4))]
    assert list(split_rowmajor(b, 3)) == [
        Box((1, 2), (1, 3)),
        Box((1, 5), (1, 1)),
        Box((2, 2), (1, 3)),
        Box((2, 5), (1, 1)),
        Box((3, 2), (1, 3)),
        Box((3, 5), (1, 1)),
    ]
    assert list(split_rowmajor(Box((), ()), 1)) == [Box((), ())]


# ---------------------------------------------------------------------------------------------
# chunk_dim0


@FAST
@given(ranked_shapes, st.integers(1, 10))
def test_chunk_dim0_matches_torch_chunk(shape, world):
    boxes = chunk_dim0(shape, world)
    assert len(boxes) == world
    want = [c.shape[0] for c in torch.chunk(torch.empty(shape[0]), world)]
    want += [0] * (world - len(want))
    assert [b.sizes[0] for b in boxes] == want
    start = 0
    for b in boxes:
        assert in_bounds(b, shape)
        assert b.sizes[1:] == tuple(shape[1:]) and all(o == 0 for o in b.offsets[1:])
        if b.sizes[0]:
            assert b.offsets[0] == start
        start += b.sizes[0]
    assert start == shape[0]
    assert coverage(shape, list(boxes)).exact


def test_chunk_dim0_examples():
    assert [b.sizes[0] for b in chunk_dim0((5,), 2)] == [3, 2]
    assert [b.sizes[0] for b in chunk_dim0((4, 7), 3)] == [2, 2, 0]
    assert [b.sizes[0] for b in chunk_dim0((5, 2), 4)] == [2, 2, 1, 0]
    assert [b.sizes[0] for b in chunk_dim0((1,), 3)] == [1, 0, 0]
    assert [b.sizes[0] for b in chunk_dim0((0, 3), 2)] == [0, 0]
    assert chunk_dim0((6, 2), 3)[1] == Box((2, 0), (2, 2))
    with pytest.raises(ValueError):
        chunk_dim0((), 2)
    with pytest.raises(ValueError):
        chunk_dim0((4,), 0)


# ---------------------------------------------------------------------------------------------
# any two layouts: resharding plan covers every target piece exactly once


@st.composite
def two_layouts(draw):
    shape = draw(ranked_shapes)
    a = list(chunk_dim0(shape, draw(st.integers(1, 8))))
    b = draw(flat_partition(math.prod(shape)))
    extra = draw(mixed_layout(shape))
    layouts = [a, b, extra]
    i, j = draw(st.permutations(range(3)))[:2]
    return shape, layouts[i], layouts[j]


@MEDIUM
@given(two_layouts())
def test_any_two_layouts_source_covers_each_target_once(args):
    shape, source, target = args
    src_boxes = [b for r in source for b, _ in region_boxes(r, shape)]
    for tgt in target:
        for tbox, _ in region_boxes(tgt, shape):
            parts = [p for p in (intersect(tbox, s) for s in src_boxes) if p is not None]
            c = counts_of(shape, parts)
            assert np.array_equal(c, mask_of(shape, tbox).astype(np.int64)), (shape, tbox)
            assert sum(p.numel for p in parts) == tbox.numel
            for p in parts:
                assert contains(tbox, p)


def test_row_major_strides():
    assert row_major_strides((2, 3, 4)) == (12, 4, 1)
    assert row_major_strides(()) == ()
    assert row_major_strides((3, 0, 2)) == (2, 2, 1)


def test_standard_layouts_as_values():
    """Writers receive layouts as values: FSDP2 chunking."""
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.index.layouts import fsdp2_layout
    from conftest import DATA

    index = open_checkpoint(str(DATA / "fsdp2_w2")).index
    fsdp = fsdp2_layout(index, 3)
    emb = fsdp.tensors["model.embed.weight"]
    assert [(a.rank, a.box.sizes[0]) for a in emb] == [(0, 13), (1, 13), (2, 11)]
    assert fsdp.tensors["model.temperature"] == [Assignment(0, Box((), ()))]  # 0-d: whole, once


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=3), st.data())
def test_end_to_end_shortcut_agrees_with_the_box_sweep(shape, data):
    """coverage's shortcut (one whole region, flat runs meeting end to end, nothing for an empty
    tensor) says exact only where the general sweep says exact; otherwise it gives no verdict."""
    from ckptkit.index import geometry

    shape = tuple(shape)
    numel = math.prod(shape)
    if data.draw(st.booleans()):  # flat runs: cut points, then a few mistakes
        cuts = sorted(data.draw(st.lists(st.integers(0, numel), max_size=4)))
        bounds = [0, *cuts, numel]
        regions = [FlatRange(a, b - a) for a, b in zip(bounds, bounds[1:])]
        for _ in range(data.draw(st.integers(0, 2))):
            regions.append(FlatRange(data.draw(st.integers(-1, numel + 1)), data.draw(st.integers(-1, 3))))
        regions = data.draw(st.permutations(regions))
    else:  # boxes: the whole tensor, or one box that may fall short or run past it
        sizes = tuple(data.draw(st.integers(0, d + 1)) for d in shape)
        offsets = tuple(data.draw(st.integers(0, 1)) for _ in shape)
        regions = [Box(offsets, sizes)] * data.draw(st.integers(0, 2))
    fast = geometry._tiles_end_to_end(shape, regions)
    if fast:
        assert geometry._coverage_by_boxes(shape, regions, 1).exact
    assert geometry.coverage(shape, regions).exact == geometry._coverage_by_boxes(shape, regions, 16).exact
