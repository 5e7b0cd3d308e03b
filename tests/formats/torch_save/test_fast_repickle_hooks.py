"""repickle.fast_dumps with the torch.save archive writer's hooks (a ZeRO-3 model
states file holds one tensor per parameter, 100k of them, too many for pickle._Pickler's
per-object machinery) writes the FaithfulPickler's bytes and records the same storages.

Random structures of what the writers pickle (plain containers, OrderedDicts, stand-ins, torch
small types, lazy and small tensors, repeated objects) must give the same data.pkl and the same
slots either way; a structure the fast writer declines (a torch tensor, an OrderedDict with
attributes) must give them too, its hooks' slots from the declined try forgotten."""

from __future__ import annotations

import collections
import random

import pytest

from ckptkit import repickle
from ckptkit.formats.torch_save import archive_writer
from ckptkit.formats.torch_save.archive_writer import LazyTensor, _Builder
from ckptkit.index.types import Box, Location, Piece, TensorEntry
from ckptkit.repickle import stand_in, stand_in_call
from ckptkit.torch_types import DType, GlobalRef, Size, SmallTensor

_DTYPES = ["float32", "bfloat16", "float16", "int64", "uint16", "float8_e4m3fn"]


def _faithful(obj) -> tuple[bytes, list]:
    builder = _Builder()
    data = repickle.dumps(obj, 2, builder.persistent_id, builder.reduce)
    return data, [(s.key, s.dtype, s.numel, s.lazy is not None) for s in builder.slots]


def _ours(obj) -> tuple[bytes, list]:
    builder = _Builder()
    data = archive_writer._pickle(obj, builder)
    return data, [(s.key, s.dtype, s.numel, s.lazy is not None) for s in builder.slots]


def _value(rng: random.Random, pool: list, depth: int):
    r = rng.random()
    if pool and r < 0.15:
        return rng.choice(pool)  # the same object again: a memo reference (or, for a SmallTensor, a new slot)
    if depth > 3 or r < 0.45:
        kind = rng.randrange(9)
        if kind == 0:
            shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
            dtype = rng.choice(_DTYPES)
            obj = LazyTensor(
                TensorEntry(f"t{rng.random()}", dtype, shape, [Piece(Box.whole(shape), Location("f", 0, 0))])
            )
        elif kind == 1:
            shape = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 2)))
            n = 1
            for s in shape:
                n *= s
            obj = SmallTensor("float32", shape, bytes(4 * n))
        elif kind == 2:
            obj = rng.choice([0, 7, 300, 70000, -5, 2**40, -(2**70), 1.5, None, True, False])
        elif kind == 3:
            obj = rng.choice(["w", "exp_avg", "module.layer.0.weight", "é", ""]) + str(rng.randrange(3))
        elif kind == 4:
            obj = Size(tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3))))
        elif kind == 5:
            obj = DType(rng.choice(["float32", "bfloat16"]))
        elif kind == 6:
            obj = GlobalRef("torch", rng.choice(["float32", "strided"]))
        elif kind == 7:
            obj = stand_in("deepspeed.runtime.fp16.loss_scaler.LossScaler", cur_scale=rng.random())
        else:
            obj = stand_in_call("deepspeed.runtime.zero.config.ZeroStageEnum", rng.randrange(4))
    else:
        kind = rng.randrange(5)
        n = rng.choice([0, 1, 2, 3, 5, rng.randint(0, 1200)]) if depth == 0 else rng.randint(0, 4)
        items = [_value(rng, pool, depth + 1) for _ in range(n)]
        if kind == 0:
            obj = items
        elif kind == 1:
            obj = tuple(items)
        elif kind == 2:
            obj = {f"k{i}": v for i, v in enumerate(items)}
        elif kind == 3:
            obj = collections.OrderedDict((f"p{i}", v) for i, v in enumerate(items))
        else:
            obj = collections.OrderedDict()
    pool.append(obj)
    return obj


@pytest.mark.parametrize("seed", range(60))
def test_fast_pickling_with_hooks_is_faithful(seed: int) -> None:
    rng = random.Random(seed)
    obj = {"module": _value(rng, [], 0), "optimizer": _value(rng, [], 0), "ds_version": "0.19.8"}
    builder = _Builder()
    assert repickle.fast_dumps(obj, builder.persistent_id, builder.reduce, archive_writer._HOOKED) is not None
    assert _ours(obj) == _faithful(obj)


def test_a_declined_structure_is_pickled_faithfully_with_fresh_slots() -> None:
    torch = pytest.importorskip("torch")
    small = SmallTensor("float32", (2,), bytes(8))
    odd = collections.OrderedDict(a=1)
    odd._metadata = {"": {"version": 1}}  # torch's state_dict() carries one
    for late in (torch.zeros(3), odd):
        obj = [small, small, LazyTensor(TensorEntry("x", "float32", (2,), [])), {"late": late}]
        builder = _Builder()
        assert repickle.fast_dumps(obj, builder.persistent_id, builder.reduce, archive_writer._HOOKED) is None
        assert len(builder.slots) >= 3  # the declined try made slots...
        assert _ours(obj) == _faithful(obj)  # ...that the writer forgets


@pytest.mark.parametrize(
    "shape", [(), (0,), (5,), (300,), (70000,), (2, 3), (0, 4), (2, 3, 4, 5), (1 << 31,), (3, 1 << 20)]
)
def test_tensor_rebuild_in_one_pass_is_faithful(shape) -> None:
    """The one-pass tensor rebuild (repickle's save_rebuild): sizes and strides of every int
    encoding and length (a size past int32 falls back to the general path), storage keys that
    are strings the structure memoized before ("0", "1"), the same entry twice (one slot), a
    dtype with and without a legacy storage class, past 256 memo entries."""
    entries = [
        TensorEntry(f"e{i}", dtype, shape, [Piece(Box.whole(shape), Location("f", 0, 0))])
        for i, dtype in enumerate(["bfloat16", "float8_e4m3fn", "float32"])
    ]
    lazies = [LazyTensor(e) for e in entries]
    obj = {
        "0": str(0),
        "1": [str(1), "cpu", "storage"],
        "t": lazies,
        "again": LazyTensor(entries[0]),
        "many": [LazyTensor(TensorEntry(f"m{i}", "float16", shape, [])) for i in range(150)],
        "tail": lazies[1],
    }
    builder = _Builder()
    assert repickle.fast_dumps(obj, builder.persistent_id, builder.reduce, archive_writer._HOOKED) is not None
    assert _ours(obj) == _faithful(obj)
