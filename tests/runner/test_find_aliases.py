"""runner.stream.find_aliases (tied weights, written once): the same answer as comparing every
entry's full signature, including entries that share dtype, shape and first piece but differ later."""

from __future__ import annotations

import random

from ckptkit.index.types import Box, FlatRange, Location, Piece, TensorEntry
from ckptkit.runner.stream import find_aliases


def _reference(entries: dict[str, TensorEntry]) -> dict[str, str]:
    seen: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for key, e in entries.items():
        if not e.pieces or e.numel == 0:
            continue
        sig = (e.dtype, e.shape, tuple((p.region, p.location) for p in e.pieces))
        if sig in seen:
            aliases[key] = seen[sig]
        else:
            seen[sig] = key
    return aliases


def _entry(key: str, rng: random.Random) -> TensorEntry:
    dtype = rng.choice(["float32", "bfloat16"])
    n = rng.choice([4, 8])
    halves = rng.random() < 0.5
    file = rng.choice(["a", "b"])
    first = rng.choice([0, 64])
    if halves:
        pieces = [
            Piece(FlatRange(0, n // 2), Location(file, first, n * 2)),
            Piece(FlatRange(n // 2, n // 2), Location(file, rng.choice([128, 256]), n * 2)),
        ]
    else:
        pieces = [Piece(Box((0,), (n,)), Location(file, first, n * 4))]
    return TensorEntry(key, dtype, (n,), pieces)


def test_same_aliases_as_full_signatures():
    rng = random.Random(7)
    for _ in range(200):
        entries = {f"t{i}": _entry(f"t{i}", rng) for i in range(rng.randint(1, 12))}
        entries["empty"] = TensorEntry("empty", "float32", (0,), [])
        assert find_aliases(entries) == _reference(entries)
    tied = {"a": _entry("a", random.Random(1))}
    tied["b"] = TensorEntry("b", tied["a"].dtype, tied["a"].shape, list(tied["a"].pieces))
    assert find_aliases(tied) == {"b": "a"}
