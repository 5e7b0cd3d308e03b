"""The DeepSpeed reader's and writer's shared pieces: the one "same value" rule for optimizer
values kept whole, the per-rank placement of both stage families, and masters of a dtype other
than fp32 read as what they are (or refused when they are not floating point)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ckptkit.errors import FormatError
from ckptkit.formats.deepspeed import group_plan, partition
from ckptkit.formats.deepspeed.values import same_value
from ckptkit.formats.registry import open_checkpoint
from ckptkit.ops.reshard import reshard
from ckptkit.repickle import stand_in
from ckptkit.runner.fetch import Fetcher
from ckptkit.torch_types import SmallTensor
from helpers.ds_fixtures import DS_DATA, ds_fixtures

NAN = float("nan")
SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class _Uncomparable:
    def __eq__(self, other: object) -> bool:
        raise TypeError("no comparison")


def _small(value: float, dtype: str = "float32") -> SmallTensor:
    return SmallTensor(dtype, (), np.array(value, dtype=dtype).tobytes())


SAME_VALUE_TABLE = [
    # (a, b, same?, why)
    (3, 3, True, "equal ints"),
    (3, 3.0, False, "an int step and a float step are different types"),
    (True, 1, False, "a bool is not an int"),
    (NAN, NAN, True, "NaN equals NaN"),
    (NAN, 1.0, False, "NaN is not a number"),
    (0.5, 0.25, False, "different floats"),
    ("adam", "adam", True, "equal strings"),
    (None, None, True, "None"),
    ([1, NAN, (2, "x")], [1, NAN, (2, "x")], True, "nested containers, NaN inside"),
    ([1, 2], [1, 2, 3], False, "lists of different lengths"),
    ([1, 2], (1, 2), False, "list and tuple"),
    ({"a": 1, "b": NAN}, {"a": 1, "b": NAN}, True, "dicts, NaN inside"),
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}, False, "dicts in another key order"),
    (
        stand_in(SCALER, cur_scale=1.0, dynamic=False),
        stand_in(SCALER, cur_scale=1.0, dynamic=False),
        True,
        "stand-ins holding the same state",
    ),
    (
        stand_in(SCALER, cur_scale=1.0, dynamic=False),
        stand_in(SCALER, cur_scale=2.0, dynamic=False),
        False,
        "stand-ins holding different state",
    ),
    (_small(7.0), _small(7.0), True, "SmallTensors with the same bytes"),
    (_small(7.0), _small(8.0), False, "SmallTensors with different bytes"),
    (torch.tensor(5.0), torch.tensor(5.0), True, "0-d torch tensors"),
    (torch.tensor(5.0), torch.tensor(5.0, dtype=torch.float64), False, "torch tensors of different dtypes"),
    (torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 2.0]]), False, "torch tensors of different shapes"),
    (torch.tensor([NAN, 1.0]), torch.tensor([NAN, 1.0]), True, "torch tensors with NaN: the same bytes"),
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), False, "torch tensors with different values"),
    (
        torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        True,
        "bf16 tensors (no numpy dtype)",
    ),
    (torch.tensor([0.0]), torch.tensor([-0.0]), False, "0.0 and -0.0 differ in their bytes"),
    (_Uncomparable(), _Uncomparable(), False, "values that cannot be compared are different"),
]


@pytest.mark.parametrize("a,b,same,why", SAME_VALUE_TABLE, ids=[row[3] for row in SAME_VALUE_TABLE])
def test_same_value(a, b, same, why):
    assert same_value(a, b) is same, why
    assert same_value(b, a) is same, why


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("stage", [2, 3])
def test_rank_shares_cover_every_element_once(stage, world):
    params = [("a", 10), ("b", 0), ("c", 7), ("d", 1), ("e", 33)]
    paddings = [2, 0, 1, 3, 0] if stage < 3 else None
    shares = partition.rank_shares(stage, params, paddings, world)
    assert len(shares) == world
    seen = {name: [0] * numel for name, numel in params}
    sizes = {share.size for share in shares}
    assert len(sizes) == 1  # every rank's partition has one length
    for share in shares:
        assert 0 <= share.own <= share.size and share.end_padding == share.size - share.own
        end = 0
        for slot in share.slots:
            assert slot.length > 0 and slot.position >= end  # in order, never overlapping
            end = slot.position + slot.length
            for i in range(slot.start, slot.start + slot.length):
                seen[slot.name][i] += 1
        assert end <= share.own
    assert all(count == 1 for counts in seen.values() for count in counts)
    if stage < 3:
        total = sum(n for _, n in params) + sum(paddings)
        assert sizes.pop() * world == math.ceil(total / (2 * world)) * 2 * world
    else:
        assert sizes.pop() == sum(math.ceil(n / world) for _, n in params)


def test_stage12_shares_follow_deepspeed_bookkeeping():
    """Rank r owns [r*ps, (r+1)*ps) of the group's padded flat buffer (alignment padding inside)."""
    shares = partition.stage12_shares([("a", 5), ("b", 6)], [1, 0], 2)
    # 12 elements padded to 12 (a multiple of 2*2): ps = 6
    assert [(s.name, s.start, s.length, s.position) for s in shares[0].slots] == [("a", 0, 5, 0)]
    assert [(s.name, s.start, s.length, s.position) for s in shares[1].slots] == [("b", 0, 6, 0)]
    assert (shares[0].own, shares[0].size, shares[1].own) == (6, 6, 6)
    shares = partition.stage12_shares([("a", 5)], None, 2)  # 5 padded to 8: ps = 4
    assert [(s.start, s.length, s.position) for s in shares[1].slots] == [(4, 1, 0)]
    assert (shares[1].own, shares[1].end_padding) == (1, 3)


FIXTURES = ds_fixtures()
needs_fixtures = pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures")


@needs_fixtures
@pytest.mark.parametrize("name", [n for n in ("z2_fp32_w2", "z3_fp32_w2") if n in FIXTURES])
def test_masters_of_another_float_dtype_are_read_as_that_dtype(tmp_path, monkeypatch, name):
    """A checkpoint whose flat masters are bf16 (not DeepSpeed's fp32) is read with bf16 masters,
    each element where it belongs: the fp32 source cast to bf16."""
    monkeypatch.setattr(group_plan, "master_dtype", lambda index, names: "bfloat16")
    reshard(str(DS_DATA / name), str(tmp_path / "out"), 3)
    src = open_checkpoint(str(DS_DATA / name))
    out = open_checkpoint(str(tmp_path / "out"))
    masters = [k for k, e in src.index.tensors.items() if e.attrs.get("ds_role") == "fp32_master"]
    assert masters
    f_src, f_out = Fetcher(src.source, index=src.index), Fetcher(out.source, index=out.index)
    for key in masters:
        entry = out.index.tensors[key]
        assert entry.dtype == "bfloat16", key
        expected = f_src.fetch(src.index.tensors[key]).to(torch.bfloat16)
        assert torch.equal(f_out.fetch(entry), expected), key
    exp_avg = next(k for k in src.index.tensors if k.endswith(".exp_avg"))
    assert out.index.tensors[exp_avg].dtype == "float32"  # the moments keep their own dtype


@needs_fixtures
def test_masters_that_are_not_floating_point_are_refused(tmp_path, monkeypatch):
    name = "z2_fp32_w2" if "z2_fp32_w2" in FIXTURES else FIXTURES[0]
    monkeypatch.setattr(group_plan, "master_dtype", lambda index, names: "int32")
    reshard(str(DS_DATA / name), str(tmp_path / "out"), 2)
    with pytest.raises(
        FormatError,
        match=r"optim_states\.pt: fp32 partition of (sub-)?group 0 is 'int32', "
        r"expected a floating-point tensor \(the optimizer's master weights\)",
    ):
        open_checkpoint(str(tmp_path / "out"))
