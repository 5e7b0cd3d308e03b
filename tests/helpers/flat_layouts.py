"""Random flat layouts as readers store them, and the box planner's answer for a range of one: what
the 1-D sweep (runner/flat_plan) and flat tables (runner/flat_table) must agree with."""

from __future__ import annotations

import random

from ckptkit.errors import FormatError
from ckptkit.index import geometry
from ckptkit.index.types import Box, CheckpointIndex, Encoding, FlatRange, Location, Piece, TensorEntry
from ckptkit.index.virtual import inline_tensor
from ckptkit.runner.plan import check_tiling, plan_byte_ranges, plan_reads
from ckptkit.torch_types import SmallTensor

ITEM_SIZE = {"float32": 4, "bfloat16": 2}


def boxed_ranges(index: CheckpointIndex, entry: TensorEntry, start: int, length: int | None):
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


def merged_ranges(ranges):
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


def outcome(call):
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


def stored_tensor(rng: random.Random, key: str, dtype: str, broken: bool) -> TensorEntry:
    """A tensor of random shape stored in one of the layouts readers produce."""
    shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
    numel = 1
    for s in shape:
        numel *= s
    item = ITEM_SIZE[dtype]
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
