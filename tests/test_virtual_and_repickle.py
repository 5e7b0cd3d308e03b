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
from conftest import DATA


@pytest.fixture(scope="module")
def opened():
    o = open_checkpoint(str(DATA / "fsdp2_w3"))
    return o, Fetcher(o.source, index=o.index)


def _flat(fetcher, index, key):
    return fetcher.fetch(index.tensors[key]).reshape(-1)


def test_flat_concat_and_slices_equal_torch_cat(opened):
    o, f = opened
    parts = [Part("model.pos", 0, 50), Part(None, 0, 3), Part("model.embed.weight", 7, 300), Part(None, 0, 5)]
    expected = torch.cat([_flat(f, o.index, "model.pos"), torch.zeros(3),
                          _flat(f, o.index, "model.embed.weight")[7:307], torch.zeros(5)])
    assert torch.equal(f.fetch(flat_concat("v", "float32", parts)), expected)
    for start, length in [(0, 1), (45, 100), (52, 4), (350, 8), (300, 100)]:
        got = f.fetch(flat_slice("s", "float32", parts, start, length))
        want = torch.cat([expected[start:start + length], torch.zeros(max(0, start + length - len(expected)))])
        assert torch.equal(got, want), (start, length)


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
