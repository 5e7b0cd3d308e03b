"""Virtual tensors (ranges of other tensors plus zero padding) and faithful re-pickling."""

from __future__ import annotations

import enum
import pickle
import sys
import types

import pytest
import torch

from ckptkit.formats.registry import open_checkpoint
from ckptkit.index.virtual import Part, flat_concat, flat_slice
from ckptkit.repickle import dumps
from ckptkit.runner.fetch import Fetcher
from ckptkit.safeload import inert_class, register_allowed, restricted_loads
from conftest import DATA, dataclass_fields as _fields


@pytest.fixture(scope="module")
def opened():
    o = open_checkpoint(str(DATA / "fsdp2_w3"))
    return o, Fetcher(o.source, index=o.index)


def _flat(fetcher, index, key):
    return fetcher.fetch(index.tensors[key]).reshape(-1)


def test_flat_concat_and_slices_equal_torch_cat(opened):
    o, f = opened
    parts = [Part("model.pos", 0, 50), Part(None, 0, 3), Part("model.embed.weight", 7, 300), Part(None, 0, 5)]
    expected = torch.cat(
        [_flat(f, o.index, "model.pos"), torch.zeros(3), _flat(f, o.index, "model.embed.weight")[7:307], torch.zeros(5)]
    )
    assert torch.equal(f.fetch(flat_concat("v", "float32", parts)), expected)
    for start, length in [(0, 1), (45, 100), (52, 4), (350, 8), (300, 100)]:
        got = f.fetch(flat_slice("s", "float32", parts, start, length))
        want = torch.cat([expected[start : start + length], torch.zeros(max(0, start + length - len(expected)))])
        assert torch.equal(got, want), (start, length)


def _reference_slice(key, dtype, parts, start, length):
    """flat_slice and flat_concat as they were first written (every part copied, a
    zeros Location per padding piece)."""
    from ckptkit.index.types import FlatRange, Location, Piece, TensorEntry
    from ckptkit.index.virtual import REF, ZEROS

    out, pos, end = [], 0, start + length
    for part in parts:
        lo, hi = max(pos, start), min(pos + part.length, end)
        if hi > lo:
            out.append(Part(part.key, part.start + lo - pos if part.key is not None else 0, hi - lo))
        pos += part.length
    covered = sum(p.length for p in out)
    if covered < length:
        out.append(Part(None, 0, length - covered))
    pieces, pos = [], 0
    for part in out:
        if part.length <= 0:
            continue
        loc = Location("", 0, 0, ZEROS) if part.key is None else Location(part.key, part.start, part.length, REF)
        pieces.append(Piece(FlatRange(pos, part.length), loc))
        pos += part.length
    return TensorEntry(key, dtype, (pos,), pieces, attrs={"virtual": True})


@pytest.mark.parametrize("seed", range(20))
def test_flat_slice_builds_the_same_pieces(seed):
    """Parts wholly inside a slice reused, cut ones and zeros rebuilt, one shared zeros Location:
    the same pieces (equal, same fields, same hashes) as before."""
    import random

    rng = random.Random(seed)
    parts = [Part(None if rng.random() < 0.3 else f"p{i}", rng.randrange(5), rng.randrange(0, 6)) for i in range(30)]
    total = sum(p.length for p in parts)
    for start, length in [(0, total), (0, total + 7), (rng.randrange(total + 1), rng.randrange(total + 3))]:
        got, want = (
            flat_slice("s", "float32", parts, start, length),
            _reference_slice("s", "float32", parts, start, length),
        )
        assert got == want
        assert [(_fields(p), _fields(p.region), _fields(p.location)) for p in got.pieces] == [
            (_fields(p), _fields(p.region), _fields(p.location)) for p in want.pieces
        ]
        assert [hash(p) for p in got.pieces] == [hash(p) for p in want.pieces]


def test_virtual_ref_to_unknown_tensor_is_an_error(opened):
    from ckptkit.errors import FormatError

    o, f = opened
    with pytest.raises(FormatError, match="unknown tensor 'nope'"):
        f.fetch(flat_concat("v", "float32", [Part("nope", 0, 4)]))


def test_stand_ins_are_re_emitted_as_their_original_classes(monkeypatch):
    mod = types.ModuleType("ckptkit_test_foreign")

    class LossScaler:
        def __init__(self):
            self.cur_scale, self.dynamic = 65536.0, True

    class Stage(enum.IntEnum):
        OPTIMIZER = 1
        WEIGHTS = 3

    for cls in (LossScaler, Stage):
        cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
        setattr(mod, cls.__name__, cls)
        register_allowed(mod.__name__, cls.__name__, inert_class(f"{mod.__name__}.{cls.__name__}"))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    original = {"scaler": LossScaler(), "stage": Stage.WEIGHTS, "plain": [1, 2.5, (3, "x")]}
    stand_ins = restricted_loads(pickle.dumps(original, protocol=2), "test")
    assert type(stand_ins["scaler"]).__name__ == "LossScaler"  # inert, no code of the class ran
    back = pickle.loads(dumps(stand_ins))  # the real classes, as the framework will load them
    assert isinstance(back["scaler"], LossScaler) and back["scaler"].__dict__ == original["scaler"].__dict__
    assert back["stage"] is Stage.WEIGHTS and back["plain"] == original["plain"]


def test_fast_crc32_agrees_with_zlib():
    import os
    import zlib

    from ckptkit.storage.checksum import crc32

    data = os.urandom(1 << 20)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1000:], crc32(data[:1000])) == zlib.crc32(data)
