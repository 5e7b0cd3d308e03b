"""DeepSpeed mixture of experts with tensor parallelism (Megatron-style mpu, deepspeed.moe.layer.MoE
with enable_expert_tensor_parallelism, tp=2 ep=2: world 4 at ZeRO 2 fp32 and ZeRO 1 bf16, world 8
(expert groups over 2 expert-dp ranks) at ZeRO 2 fp32):
fixtures/generate_ds_moe_tp.py, truth from safe_get_full_fp32_param / safe_get_full_optimizer_state
on every rank, assembled over tp.

Read (moe.py per mp rank, joined by join_tp.py) and consolidated bit for bit; `inspect` shows
each tensor's tp and ep split; reshard (resharding.py) to new tp, ep and dp reads back equal,
and at the same sizes is DeepSpeed's own files object for object (both in test_layout_matrix.py).
DeepSpeed loads a reshard at tp=4,ep=1,dp=1, every master, moment and module weight equal to the
truth cut for its rank, and trains a step (test_ds_engine_matrix.py).

Whole experts (enable_expert_tensor_parallelism=False, fixture moetp_noexptp_*: join_ep.py,
split_ep.py): read and consolidated bit for bit, resharded to new tp/ep/dp (read back equal,
same sizes = DeepSpeed's files: test_layout_matrix.py), DeepSpeed loading tp=4,ep=4,dp=1
(test_ds_engine_matrix.py; by hand also tp=2,ep=4,dp=2; --to 6; tp=1,ep=2,dp=2 and the same sizes).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptkit.ops.consolidate import consolidate
from ckptkit.ops.reshard import reshard
from conftest import DATA, assert_tensor_equal, read_all
from helpers.ds_fixtures import assert_same_pickled

MT_DATA = DATA / "ds_moe_tp"
FIXTURES = (
    sorted(p.name for p in MT_DATA.iterdir() if p.is_dir() and "noexptp" not in p.name) if MT_DATA.is_dir() else []
)
NO_EXPERT_TP = "moetp_noexptp_z2_fp32_tp2_ep2_w4"  # MoE(enable_expert_tensor_parallelism=False): whole experts
WHOLE = [NO_EXPERT_TP, "moetp_noexptp_z1_bf16_tp2_ep2_w4"]  # the same at ZeRO 1 bf16
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no MoE + TP fixtures (run fixtures/generate_ds_moe_tp.py)")
EXPERTS = "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts."


def _truth(name):
    return torch.load(MT_DATA / f"{name}.truth.pt", weights_only=True)


def _info(name):
    return json.loads((MT_DATA / name / "fixture.json").read_text())


def _params(truth) -> list[str]:
    return [k[len("fp32.") :] for k in truth if k.startswith("fp32.")]


def _cli(*args):
    from ckptkit_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _equal_to_truth(tensors: dict, truth: dict) -> int:
    compared = 0
    for p in _params(truth):
        assert_tensor_equal(tensors[f"model.{p}"], truth[f"fp32.{p}"], p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(tensors[f"optim.state.{p}.{key}"], truth[f"{key}.{p}"], f"{p}.{key}")
        assert_tensor_equal(tensors[f"ds_module.{p}"], truth[f"module.{p}"], f"module {p}")
        compared += 1
    return compared


def test_fixtures_cover_expert_dp_sizes_1_and_2():
    assert {_info(n)["expert_dp"] for n in FIXTURES} == {1, 2}


@pytest.mark.parametrize("name", FIXTURES)
def test_ranks_as_deepspeed_grouped_them(name):
    """Global rank r: tp rank r % T, dp rank r // T; in its tp lane ep rank dp % E, expert-dp dp // E
    (what moe.py assumes per mp rank), as DeepSpeed's groups reported them."""
    info = _info(name)
    for rank, seen in info["ranks"].items():
        r, dp = int(rank), int(rank) // info["tp"]
        assert seen == {"tp": r % info["tp"], "dp": dp, "ep": dp % info["ep"], "expert_dp": dp // info["ep"]}


@pytest.mark.parametrize("name", FIXTURES)
def test_reader_equals_deepspeed_truth_with_tp_and_ep_marked(name):
    truth = _truth(name)
    opened, tensors, objects = read_all(MT_DATA / name)
    index = opened.index
    assert _equal_to_truth(tensors, truth) == 28 == len([k for k in index.tensors if k.startswith("model.")])
    assert sum(1 for p in _params(truth) if EXPERTS in p) == 4 * 4  # 4 experts, 4 params each, global ids
    assert index.metadata["parallel"] == {"tp": 2, "ep": 2, "dp": _info(name)["dp"]}
    assert index.metadata["deepspeed_moe"] == {
        "ep_size": 2,
        "expert_dp_size": _info(name)["expert_dp"],
        "num_experts": {"layers.0.mlp": 4},
    }
    for e in range(4):
        entry = index.tensors[f"model.{EXPERTS}{e}.dense_4h_to_h.weight"]
        assert entry.attrs["parallel"] == {"ep": {"rank": e // 2, "size": 2}, "tp": {"dim": 1, "size": 2}}
    gate = index.tensors["model.layers.0.mlp.deepspeed_moe.gate.wg.weight"]
    assert gate.attrs["parallel"] == {"tp": {"dim": None, "size": 2}}  # the router: replicated
    assert objects["ds.global_steps"] == truth["global_steps"] == 2


@pytest.mark.parametrize("name", FIXTURES)
def test_consolidate_with_optimizer_bit_exact(tmp_path, name):
    truth = _truth(name)
    consolidate(str(MT_DATA / name), str(tmp_path / "out"), include_optimizer=True)
    model = load_file(str(tmp_path / "out" / "model.safetensors"))
    optim = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    assert set(model) == set(_params(truth))
    for p in _params(truth):
        assert_tensor_equal(model[p], truth[f"fp32.{p}"], p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(optim[f"state.{p}.{key}"], truth[f"{key}.{p}"], f"{p}.{key}")


def test_inspect_shows_the_tp_and_ep_splits():
    res = _cli("inspect", MT_DATA / "moetp_z2_fp32_tp2_ep2_w4")
    assert res.exit_code == 0, res.output
    assert "tp 2 x ep 2 x dp 2" in res.output
    assert "tp dim 1/2, ep rank 1/2" in res.output and "tp fused(3) dim 0/2" in res.output


def test_a_rewrite_of_a_rewrite_is_the_source_again(tmp_path):
    """tp 2 -> 4 -> 2 and ep 2 -> 1 -> 2: the files equal the same-size rewrite byte for byte."""
    name = "moetp_z2_fp32_tp2_ep2_w4"
    reshard(str(MT_DATA / name), str(tmp_path / "a"), "tp=2,ep=2,dp=2")
    reshard(str(MT_DATA / name), str(tmp_path / "b"), "tp=4,ep=1,dp=1")
    reshard(str(tmp_path / "b"), str(tmp_path / "c"), "tp=2,ep=2,dp=2")
    for f in sorted((tmp_path / "a" / "global_step2").iterdir()):
        if "expert" in f.name:  # copied from the source in a, written from slices in c: same tensors
            assert_same_pickled(
                torch.load(f, weights_only=True),
                torch.load(tmp_path / "c" / "global_step2" / f.name, weights_only=True),
                f.name,
            )
            continue
        assert (tmp_path / "c" / "global_step2" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize(
    "to,needles",
    [
        ("tp=2,ep=3,dp=3", ("has 4 experts", "3 expert-parallel")),
        ("tp=2,ep=4,dp=2", ("must divide the data-parallel size",)),
        ("tp=2,pp=2,ep=2,dp=2", ("pipeline parallelism",)),
        ("6", ("does not divide 6 ranks",)),
    ],
)
def test_sizes_that_cannot_be_written_are_refused_in_one_sentence(tmp_path, to, needles):
    res = _cli("reshard", MT_DATA / "moetp_z2_fp32_tp2_ep2_w4", tmp_path / "out", "--to", to)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    for n in needles:
        assert n in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_whole_experts_layout_as_deepspeed_grouped_it():
    """enable_expert_tensor_parallelism=False under an mpu: DeepSpeed 0.19.8 builds the expert groups
    from consecutive global ranks (rank r: ep rank r % E, expert-dp rank r // E), so with E = T the tp
    ranks are the ep ranks, and the ep rank's expert-dp rank 0 (global rank e, mp rank e % T) saves
    its experts whole (what join_ep.py assumes)."""
    info = _info(NO_EXPERT_TP)
    for rank, seen in info["ranks"].items():
        r = int(rank)
        assert seen == {"tp": r % 2, "dp": r // 2, "ep": r % 2, "expert_dp": r // 2}
    assert info["expert_dp"] == 2  # the expert groups span both tp lanes: 4 ranks / ep 2
    assert sorted(f for f in info["files"] if "expert" in f) == [
        f"layer_0_expert_{g}_mp_rank_{(g // 2) % 2:02d}_model_states.pt" for g in range(4)
    ]


@pytest.mark.parametrize("name", WHOLE)
def test_whole_experts_read_and_consolidated_bit_exact(tmp_path, name):
    """The experts gathered from the mp ranks that hold them (whole: ep only, no tp), the dense
    weights joined over tp; every master, moment and module weight equal to DeepSpeed's truth."""
    truth = _truth(name)
    opened, tensors, objects = read_all(MT_DATA / name)
    index = opened.index
    assert _equal_to_truth(tensors, truth) == 28 == len([k for k in index.tensors if k.startswith("model.")])
    assert index.metadata["parallel"] == {"tp": 2, "ep": 2, "dp": 2}
    assert index.metadata["deepspeed_moe"] == {
        "ep_size": 2,
        "expert_dp_size": 2,
        "num_experts": {"layers.0.mlp": 4},
        "experts": "whole",
    }
    for e in range(4):
        for kind in ("model", "ds_module"):
            entry = index.tensors[f"{kind}.{EXPERTS}{e}.dense_4h_to_h.weight"]
            assert entry.attrs["parallel"] == {"ep": {"rank": e // 2, "size": 2}}, kind
    assert objects["optim.param_groups.2.params"] == [
        f"{EXPERTS}{e}.{p}.weight" for e in range(4) for p in ("dense_h_to_4h", "dense_4h_to_h")
    ]
    consolidate(str(MT_DATA / name), str(tmp_path / "out"), include_optimizer=True)
    model = load_file(str(tmp_path / "out" / "model.safetensors"))
    optim = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    assert set(model) == set(_params(truth))
    for p in _params(truth):
        assert_tensor_equal(model[p], truth[f"fp32.{p}"], p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(optim[f"state.{p}.{key}"], truth[f"{key}.{p}"], f"{p}.{key}")


def test_inspect_shows_whole_experts_by_ep_rank_only():
    res = _cli("inspect", MT_DATA / NO_EXPERT_TP)
    assert res.exit_code == 0, res.output
    assert "tp 2 x ep 2 x dp 2" in res.output
    expert_rows = [ln for ln in res.output.splitlines() if "deepspeed_experts.3." in ln]
    assert expert_rows and all(ln.rstrip().endswith("ep rank 1/2") for ln in expert_rows), expert_rows
    assert "tp fused(3) dim 0/2" in res.output


@pytest.mark.parametrize(
    "to,needles",
    [
        ("tp=4,ep=2,dp=1", ("tensor-parallel size must divide the expert-parallel size", "mp_rank_02")),
        ("tp=2,ep=1,dp=2", ("tensor-parallel size must divide the expert-parallel size",)),
        ("tp=2,ep=3,dp=3", ("has 4 experts", "3 expert-parallel")),
        ("tp=2,ep=4,dp=1", ("must divide the 2 ranks",)),
        ("3", ("must both divide 3 ranks",)),
    ],
)
def test_whole_experts_sizes_that_cannot_be_written_are_refused_in_one_sentence(tmp_path, to, needles):
    """tp 4 with ep 2: DeepSpeed 0.19.8 itself could not load it (by hand: rank 2 of such an output
    looks for layer_0_expert_0_mp_rank_02_model_states.pt, which no rank saves)."""
    res = _cli("reshard", MT_DATA / NO_EXPERT_TP, tmp_path / "out", "--to", to)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    for n in needles:
        assert n in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_whole_experts_at_ep_1_with_tp_2_deepspeed_loses_a_model_file_and_we_say_so(tmp_path):
    """ep 1 < tp 2 with whole experts: DeepSpeed 0.19.8 writes model states only from global ranks
    below ep (expert-data-parallel rank 0), so mp rank 1's module weights are never saved (and
    every expert lands on mp rank 0); refused in one sentence that says why."""
    name = "moetp_noexptp_z2_fp32_tp2_ep1_w4"
    info = _info(name)
    assert "mp_rank_01_model_states.pt" not in info["files"] and "mp_rank_00_model_states.pt" in info["files"]
    assert sorted(f for f in info["files"] if "expert" in f) == [
        f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(4)
    ]
    for args in (["inspect"], ["consolidate", tmp_path / "out"]):
        res = _cli(args[0], MT_DATA / name, *args[1:])
        assert res.exit_code == 2, res.output
        assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output, res.output
        for needle in (
            "no *_model_states.pt file of model-parallel rank 1",
            "enable_expert_tensor_parallelism=False",
            "mp ranks >= ep",
        ):
            assert needle in res.output, res.output
        assert not (tmp_path / "out").exists()
