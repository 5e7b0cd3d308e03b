"""The one DeepSpeed writer's splits (resharding.py): tp, then pp, then ep, each the identity at size 1,
and the (stage, tp rank) cells they give are the grid DeepSpeed names at the target sizes.

No file is written: the splits are walked on the real fixtures as write_resharded walks them, and the
cells' model-parallel ranks are compared with DeepSpeedLayout's rank rule at the new sizes."""

from __future__ import annotations

import pytest

from ckptkit.formats.deepspeed import split_ep, split_pp, split_tp
from ckptkit.formats.deepspeed.layout import DeepSpeedLayout
from ckptkit.formats.deepspeed.native import native_of
from ckptkit.formats.registry import open_checkpoint
from ckptkit.index.parallel_spec import parse_parallel
from ckptkit.formats.deepspeed.pipeline_partition import use_partition_method
from conftest import DATA

CASES = [  # (fixture, --to, stages per lane at the target)
    ("deepspeed/z2_fp32_w2", "dp=3", 1),
    ("ds_tp/mpu_z2_fp32", "tp=1,dp=2", 1),
    ("ds_tp/mpu_z2_fp32", "tp=2,dp=1", 1),
    ("ds_pp/pp2_dp2_z1_fp32", "pp=3,dp=1", 3),
    ("ds_3d/pp2_tp2_dp2_z1_fp32", "tp=2,pp=1,dp=2", 1),
    ("ds_moe/moe_z2_fp32_w4_k1", "ep=2,dp=4", 1),
    ("ds_moe_tp/moetp_z2_fp32_tp2_ep2_w4", "tp=1,ep=2,dp=2", 1),
    ("ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4", "pp=1,ep=2,dp=2", 1),
]


def _walk(fixture: str, to: str):
    opened = open_checkpoint(str(DATA / fixture))
    index, source = opened.index, opened.source
    sizes = DeepSpeedLayout.of(index).resized(parse_parallel(to), index.root)
    lanes = list(split_tp.lanes(index, source, sizes))
    return index, sizes, [(lane, list(split_pp.stages(index, lane, sizes))) for lane in lanes]


@pytest.mark.parametrize("fixture,to,per_lane", CASES, ids=[f"{f}@{t}" for f, t, _ in CASES])
def test_the_splits_give_the_cell_grid_deepspeed_names(fixture, to, per_lane):
    use_partition_method("uniform")  # the 3-D fixture's stages (as its reshard tests give it)
    try:
        index, sizes, walked = _walk(fixture, to)
    finally:
        use_partition_method(None)
    target = DeepSpeedLayout(tp=sizes.tp, pp=sizes.pp)
    assert [lane.rank for lane, _ in walked] == list(range(sizes.tp))
    assert all(len(stages) == per_lane for _, stages in walked)
    mp_ranks = sorted(stage.mp for _, stages in walked for stage in stages)
    want = sorted(target.mp_rank(s, t) for t in range(sizes.tp) for s in range(per_lane))
    assert mp_ranks == want
    experts = DeepSpeedLayout.of(index).has_experts
    for lane, stages in walked:
        for stage in stages:
            cell = split_ep.cell(index, lane, stage, sizes)
            assert cell.mp == stage.mp
            assert (cell.experts is not None) == experts
            if experts:
                assert cell.experts.ep == sizes.ep


@pytest.mark.parametrize("fixture,to", [("deepspeed/z2_fp32_w2", "dp=3"), ("ds_moe/moe_z2_fp32_w4_k1", "ep=1,dp=2")])
def test_tp_and_pp_splits_are_the_identity_at_size_one(fixture, to):
    index, sizes, walked = _walk(fixture, to)
    [(lane, stages)] = walked
    assert lane.index is index and lane.target is None  # the source itself, nothing re-sliced
    assert lane.info is native_of(index).cell()
    [stage] = stages
    assert stage.index is index and stage.info is lane.info and stage.model is None


def test_a_plain_cell_without_experts_is_the_zero_writers_own():
    index, sizes, [(lane, [stage])] = _walk("deepspeed/z2_fp32_w2", "dp=3")
    cell = split_ep.cell(index, lane, stage, sizes)
    assert (cell.mp, cell.stage12_model, cell.stage3_model, cell.experts) == (0, None, None, None)
