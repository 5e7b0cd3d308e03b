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

from ckptkit.index.types import CheckpointIndex, FlatRange, Location, Piece, TensorEntry
from ckptkit.index.virtual import Part, flat_concat
from ckptkit.runner import flat_plan
from ckptkit.runner.plan import Planner
from helpers.flat_layouts import ITEM_SIZE, boxed_ranges, merged_ranges, outcome, stored_tensor


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
    dtype = rng.choice(list(ITEM_SIZE))
    index = CheckpointIndex("test", "/nowhere")
    for i in range(rng.randint(1, 6)):
        other = dtype if rng.random() < 0.9 else ("bfloat16" if dtype == "float32" else "float32")
        entry = stored_tensor(rng, f"t{i}", other, broken=rng.random() < 0.05)
        index.tensors[entry.key] = entry
    entries = list(index.tensors.values()) + [_partition(rng, index, dtype, rng.randint(1, 12)) for _ in range(3)]
    for entry in entries:
        requests = [(0, None)]
        for _ in range(4):
            start = rng.randint(0, entry.numel)
            requests.append((start, rng.randint(0, entry.numel - start)))
        for start, length in requests:
            want = outcome(lambda: merged_ranges(boxed_ranges(index, entry, start, length)))
            got = outcome(lambda: Planner(index).byte_ranges(entry, start, length))
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
