"""The 1-D planner (runner/flat_plan.py) against the N-d box planner it shortcuts.

On random flat layouts (parameters stored as shuffled flat runs of several files, zeros, small
values in memory, whole and 1-D boxes, row boxes that only the box planner reads, virtual ZeRO
partitions referring to all of them, dtype mismatches, reads past a piece's bytes), Planner's
byte_ranges (the sweep where it applies) must name the same bytes as the box planner: the same
ranges once adjacent ones are merged, the same None, the same refusal sentence.
"""

from __future__ import annotations

import random

import pytest

from ckptkit.errors import FormatError
from ckptkit.index import geometry
from ckptkit.index.types import Box, CheckpointIndex, Encoding, FlatRange, Location, Piece, TensorEntry
from ckptkit.index.virtual import Part, flat_concat, inline_tensor
from ckptkit.runner import flat_plan
from ckptkit.runner.plan import Planner, check_tiling, plan_byte_ranges, plan_reads
from ckptkit.torch_types import SmallTensor

_ITEM = {"float32": 4, "bfloat16": 2}


def _boxed(index: CheckpointIndex, entry: TensorEntry, start: int, length: int | None):
    """What Fetcher.byte_ranges returned before the sweep: every box of the range planned by
    plan_reads and viewed by plan_byte_ranges."""
    if start == 0 and length is None:
        return plan_byte_ranges(plan_reads(index, entry), index.tensors, entry)
    check_tiling(entry)
    length = entry.numel - start if length is None else length
    out = []
    for box, _ in geometry.flat_to_boxes(FlatRange(start, length), entry.shape):
        ranges = plan_byte_ranges(plan_reads(index, entry, box), index.tensors, entry)
        if ranges is None:
            return None
        out += ranges
    return out


def _merged(ranges):
    """The ranges with empty ones dropped and each continuing the previous merged into it."""
    if ranges is None:
        return None
    out = []
    for rel, offset, nbytes in ranges:
        if not nbytes:
            continue
        if out and out[-1][0] == rel and (rel is None or out[-1][1] + out[-1][2] == offset):
            out[-1] = (rel, out[-1][1], out[-1][2] + nbytes)
        else:
            out.append((rel, offset, nbytes))
    return out


def _outcome(call):
    try:
        return ("ok", call())
    except FormatError as exc:
        return ("error", str(exc))


def _cuts(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """[0, n) cut into runs (some empty), as (start, length)."""
    points = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 4)))) if n > 1 else []
    edges = [0] + points + [n]
    runs = [(a, b - a) for a, b in zip(edges, edges[1:])]
    if rng.random() < 0.2:
        runs.append((rng.randint(0, n), 0))
    if rng.random() < 0.03:  # refused by the box planner: an empty piece outside, a negative one
        runs.append(rng.choice([(n + 1, 0), (-1, 0), (0, -1)]))
    if rng.random() < 0.03 and runs[-1][1]:  # the tail in no piece: refused
        runs.pop()
    return runs


def _stored(rng: random.Random, key: str, dtype: str, broken: bool) -> TensorEntry:
    """A tensor of random shape stored in one of the layouts readers produce."""
    shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
    numel = 1
    for s in shape:
        numel *= s
    item = _ITEM[dtype]
    kind = rng.choice(["flat", "flat", "flat", "whole", "rows", "inline", "zeros"])
    if kind == "whole" or (kind == "rows" and not shape):
        pieces = [Piece(Box.whole(shape), Location(rng.choice("ab"), rng.randint(0, 99) * 8, numel * item))]
    elif kind == "rows":  # dim-0 chunks: boxes (a 1-D tensor's the sweep reads; others go to boxes)
        pieces = []
        for start, length in _cuts(rng, shape[0]):
            if length or (len(shape) == 1 and rng.random() < 0.3):
                sizes = (length,) + shape[1:]
                n = length * (numel // shape[0])
                pieces.append(
                    Piece(
                        Box((start,) + (0,) * (len(shape) - 1), sizes),
                        Location(rng.choice("ab"), rng.randint(0, 99) * 8, n * item),
                    )
                )
    elif kind == "inline":
        value = SmallTensor(dtype, shape, bytes(rng.randrange(256) for _ in range(numel * item)))
        entry = inline_tensor(key, value)
        entry.attrs.pop("virtual")
        return entry
    else:
        pieces = []
        for start, length in _cuts(rng, numel):
            if kind == "zeros" and rng.random() < 0.5:
                loc = Location("", 0, 0, Encoding.ZEROS)
            else:
                loc = Location(rng.choice("abc"), rng.randint(0, 99) * 8, length * item)
            pieces.append(Piece(FlatRange(start, length), loc))
    if broken and pieces:
        i = rng.randrange(len(pieces))
        loc = pieces[i].location
        if loc.encoding == Encoding.RAW and loc.length:
            pieces[i] = Piece(pieces[i].region, Location(loc.file, loc.offset, loc.length - item))
    rng.shuffle(pieces)
    return TensorEntry(key, dtype, shape, pieces)


def _partition(rng: random.Random, index: CheckpointIndex, dtype: str, n: int) -> TensorEntry:
    """A virtual ZeRO partition: flat ranges of stored tensors, with zero padding between."""
    parts = []
    keys = list(index.tensors)
    for _ in range(n):
        target = index.tensors[rng.choice(keys)]
        if rng.random() < 0.1 or target.numel == 0:
            parts.append(Part(None, 0, rng.randint(1, 4)))
            continue
        start = rng.randrange(target.numel)
        end = rng.randint(start + 1, target.numel)
        if rng.random() < 0.03:
            end = target.numel + 1  # past the end: refused
        parts.append(Part(target.key, start, end - start))
    return flat_concat(f"part.{rng.random()}", dtype, parts)


@pytest.mark.parametrize("seed", range(300))
def test_sweep_names_the_bytes_the_box_planner_names(seed: int) -> None:
    rng = random.Random(seed)
    dtype = rng.choice(list(_ITEM))
    index = CheckpointIndex("test", "/nowhere")
    for i in range(rng.randint(1, 6)):
        other = dtype if rng.random() < 0.9 else ("bfloat16" if dtype == "float32" else "float32")
        entry = _stored(rng, f"t{i}", other, broken=rng.random() < 0.05)
        index.tensors[entry.key] = entry
    entries = list(index.tensors.values()) + [_partition(rng, index, dtype, rng.randint(1, 12)) for _ in range(3)]
    for entry in entries:
        requests = [(0, None)]
        for _ in range(4):
            start = rng.randint(0, entry.numel)
            requests.append((start, rng.randint(0, entry.numel - start)))
        for start, length in requests:
            want = _outcome(lambda: _merged(_boxed(index, entry, start, length)))
            got = _outcome(lambda: Planner(index).byte_ranges(entry, start, length))
            assert got == want, (seed, entry, start, length)


def test_the_sweep_serves_zero_partitions() -> None:
    """The shortcut is taken (not only the box planner's answer repeated): a partition of
    parameters stored as flat runs is planned by the sweep, adjacent rows merged."""
    param = TensorEntry(
        "w",
        "float32",
        (4, 4),
        [Piece(FlatRange(8, 8), Location("b", 0, 32)), Piece(FlatRange(0, 8), Location("a", 64, 32))],
    )
    index = CheckpointIndex("test", "/nowhere", tensors={"w": param})
    part = flat_concat("p", "float32", [Part("w", 2, 12), Part(None, 0, 2)])
    calls = []
    got = flat_plan.flat_byte_ranges(
        part, 0, part.numel, tensors=index.tensors, tiling=lambda e: None, boxed=lambda *a: calls.append(a)
    )
    assert got == [("a", 72, 24), ("b", 0, 24), (None, 0, 8)] and not calls
    assert Planner(index).byte_ranges(part) == got
