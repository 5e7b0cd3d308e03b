"""DeepSpeed's parallel layouts as one matrix of fixture x target sizes, over every parallel fixture
family (tp; ep; tp x ep with experts sliced or whole; pp; pp x ep with one or two MoE layers a stage;
pp x tp x dp), all written by real DeepSpeed runs on CPU (fixtures/generate_ds_*.py):

- at the fixture's own sizes, `reshard` gives DeepSpeed's own files back: the same file names, and
  every file, unpickled with DeepSpeed's classes (fragment_address, ZeroStageEnum), equal object for
  object, tensors bit for bit (module slices, param_shapes, buffer names, flat partitions, slice
  mappings, paddings, partition counts, group names, world sizes, AutoTP's universal_checkpoint_info);
- at other sizes, every tensor reads back equal to the truth (DeepSpeed's own, or the source as
  ckptkit reads it, itself checked against DeepSpeed's in test_ds_*.py), in DeepSpeed's file names
  at the new sizes, with the sizes recorded where DeepSpeed and the index keep them.

Refusals, rewrites of rewrites and DeepSpeed loading the outputs stay with each layout's own file.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ckptkit.ops.reshard import reshard
from conftest import DATA, assert_tensor_equal, read_all
from helpers.corrupt import run_cli
from helpers.ds_fixtures import assert_same_pickled, needs_deepspeed


def _info(family: str, name: str) -> dict:
    return json.loads((DATA / family / name / "fixture.json").read_text())


def _folders(family: str, keep=lambda name: True) -> list[str]:
    root = DATA / family
    return sorted(p.name for p in root.iterdir() if p.is_dir() and keep(p.name)) if root.is_dir() else []


# family folder -> (its fixtures, the --to that keeps each one's sizes, whether reading DeepSpeed's
# pickles needs deepspeed, the generator to run when the fixtures are missing)
UNIFORM = ("--partition-method", "uniform")
FAMILIES = {
    "tp": (
        "ds_tp",
        _folders("ds_tp"),
        lambda i: (f"tp={i['tp']},dp={i['dp']}",),
        True,
        "generate_ds_tp.py",
    ),
    "ep": (
        "ds_moe",
        _folders("ds_moe", lambda n: n.startswith("moe")),
        lambda i: (f"ep={i['ep_size']},dp={i['world_size']}",),
        True,
        "generate_ds_moe.py",
    ),
    "tp_ep_sliced": (
        "ds_moe_tp",
        _folders("ds_moe_tp", lambda n: "noexptp" not in n),
        lambda i: (f"tp=2,ep=2,dp={i['dp']}",),
        True,
        "generate_ds_moe_tp.py",
    ),
    "tp_ep_whole": (
        "ds_moe_tp",
        ["moetp_noexptp_z2_fp32_tp2_ep2_w4", "moetp_noexptp_z1_bf16_tp2_ep2_w4"],
        lambda i: ("tp=2,ep=2,dp=2",),
        True,
        "generate_ds_moe_tp.py",
    ),
    "pp": (
        "ds_pp",
        ["pp2_dp2_z1_fp32", "pp2_dp2_z1_bf16", "pp2_dp2_z0_bf16", "pp2_dp1_z1_fp32_tiedhead", "pp2_dp2_z1_fp32_mptopo"],
        lambda i: (f"pp={i['pp']},dp={i['dp']}", *UNIFORM),
        True,
        "generate_ds_pp.py",
    ),
    "pp_ep": (
        "ds_pp_moe",
        ["ppmoe_z1_fp32_pp2_ep2_w4", "ppmoe_z1_fp32_pp2_ep2_w4_moe4"],
        lambda i: ("pp=2,ep=2,dp=2",),
        True,
        "generate_ds_pp_moe.py",
    ),
    "pp_tp_dp": (
        "ds_3d",
        _folders("ds_3d"),
        lambda i: (f"tp={i['tp']},pp={i['pp']},dp={i['dp']}", *UNIFORM),
        False,
        "generate_ds_3d.py",
    ),
}


def _same_size_cases() -> list:
    cases = []
    for family, (folder, names, _, needs_ds, generator) in FAMILIES.items():
        if not names:
            reason = f"no {folder} fixtures (run fixtures/{generator})"
            cases.append(pytest.param(family, "", marks=pytest.mark.skip(reason=reason), id=f"{family}/none"))
        for name in names:
            marks = [needs_deepspeed] if needs_ds else []
            if not (DATA / folder / name).is_dir():
                marks.append(pytest.mark.skip(reason=f"fixture {folder}/{name} missing (run fixtures/{generator})"))
            cases.append(pytest.param(family, name, marks=marks, id=f"{family}/{name}"))
    return cases


@pytest.mark.parametrize("family,name", _same_size_cases())
def test_same_sizes_rewrite_is_deepspeeds_own_files(tmp_path, family, name):
    """Sizes unchanged: the same file names, and every file equal to what DeepSpeed saved."""
    folder, _, to, _, _ = FAMILIES[family]
    source = DATA / folder / name
    res = run_cli("reshard", source, tmp_path / "out", "--to", *to(_info(folder, name)))
    assert res.code == 0, res.output
    src = source / "global_step2"
    assert sorted(p.name for p in (tmp_path / "out" / "global_step2").iterdir()) == sorted(
        p.name for p in src.iterdir()
    )
    for f in sorted(src.iterdir()):
        # DeepSpeed's own pickles (fragment_address, ZeroStageEnum): our fixtures and our output
        assert_same_pickled(
            torch.load(f, weights_only=False),
            torch.load(tmp_path / "out" / "global_step2" / f.name, weights_only=False),
            f.name,
        )


# ---- reshard to other sizes reads back equal to the truth -------------------------------------------
# Each family's targets (fixture, --to, what the output must show) and the reads that check them: the
# tensors equal the source as ckptkit reads it (itself equal to DeepSpeed's truth, test_ds_*.py) or
# DeepSpeed's own truth (<fixture>.truth.pt, taken through DeepSpeed's API at save time); DeepSpeed's
# file names at the new sizes; the sizes the index and DeepSpeed's bookkeeping record.

TP_DATA, MOE_DATA, PP_DATA = DATA / "ds_tp", DATA / "ds_moe", DATA / "ds_pp"
MT_DATA, PM_DATA, D3 = DATA / "ds_moe_tp", DATA / "ds_pp_moe", DATA / "ds_3d"


def _cli(*args):
    from ckptkit_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


# (fixture, --to, (tp, dp)): merge tp away, grow it to 4 (every split dim and fused QKV part of the
# mpu model divides by 4), odd dp (end padding), a plain world size keeping tp
TP_TARGETS = [
    ("mpu_z2_fp32", "tp=1,dp=1", (1, 1)),
    ("mpu_z2_fp32", "tp=1,dp=3", (1, 3)),
    ("mpu_z2_fp32", "tp=4,dp=1", (4, 1)),
    ("mpu_z2_fp32", "tp=4,dp=3", (4, 3)),
    ("mpu_z2_fp32", "6", (2, 3)),
    ("mpu_z1_bf16", "tp=1,dp=2", (1, 2)),
    ("mpu_z1_bf16", "tp=4,dp=5", (4, 5)),
    ("mpu_z2_bf16", "tp=2,dp=1", (2, 1)),
    ("autotp_z2_fp32", "tp=1,dp=2", (1, 2)),
    ("autotp_z2_fp32", "tp=4,dp=1", (4, 1)),
    ("autotp_z1_bf16", "tp=2,dp=3", (2, 3)),
    ("mpu_z3_fp32", "tp=1,dp=2", (1, 2)),
    ("mpu_z3_fp32", "tp=4,dp=3", (4, 3)),
    ("autotp_z3_bf16", "tp=1,dp=3", (1, 3)),
]


def _tp_reads_back(tmp_path, name, to, sizes):
    tp, dp = sizes
    res = _cli("reshard", TP_DATA / name, tmp_path / "out", "--to", to)
    assert res.exit_code == 0, res.output
    _, want, _ = read_all(TP_DATA / name)
    opened, got, objects = read_all(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for key in want:
        assert_tensor_equal(got[key], want[key], key)
    index = opened.index
    assert index.world_size == tp * dp
    if tp > 1:
        assert index.metadata["parallel"] == {"tp": tp, "dp": dp}
    assert objects["ds.mp_world_size"] == tp and objects["ds.dp_world_size"] == dp
    assert objects["ds.checkpoint_parallel_dimensions"]["tp_degree"] == tp
    tag = tmp_path / "out" / "global_step2"
    prefix = "bf16_" if any((TP_DATA / name / "global_step2").glob("bf16_*")) else ""
    models = (
        [f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt" for t in range(tp) for d in range(dp)]
        if "_z3_" in name
        else [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]
    )
    assert sorted(p.name for p in tag.iterdir()) == sorted(
        models + [f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for t in range(tp) for d in range(dp)]
    )


MARK = ".deepspeed_moe.experts.deepspeed_experts."

# (fixture, --to, expected (ep, dp)): grow and shrink ep and dp, odd worlds (end padding), a layer
# with one expert per rank (moe2 at ep 2), a plain world size keeping the source's ep
EP_TARGETS = [
    ("moe_z1_fp32_w2_k1", "ep=1,dp=1", (1, 1)),
    ("moe_z1_fp32_w2_k1", "ep=1,dp=3", (1, 3)),
    ("moe_z1_fp32_w2_k1", "ep=4,dp=8", (4, 8)),
    ("moe_z2_bf16_w2_k2", "ep=2,dp=6", (2, 6)),
    ("moe_z2_fp32_w4_k1", "ep=4,dp=4", (4, 4)),
    ("moe_z2_fp32_w4_k1", "ep=1,dp=5", (1, 5)),
    ("moe_z1_bf16_w4_k2", "ep=4,dp=12", (4, 12)),
    ("moe_z1_bf16_w4_k2", "ep=2,dp=2", (2, 2)),
    ("moe2_z2_fp32_w2_k1", "ep=1,dp=3", (1, 3)),
    ("moe2_z2_fp32_w2_k1", "4", (2, 4)),
]


def _moe_info(name):
    return json.loads((MOE_DATA / name / "fixture.json").read_text())


def _expert_counts(name) -> dict[str, int]:
    info = _moe_info(name)
    return {
        "moe": info["num_experts"],
        **({"moe2": info["second_moe_experts"]} if info.get("second_moe_experts") else {}),
    }


def _ep_reads_back(tmp_path, name, to, sizes):
    ep, dp = sizes
    reshard(str(MOE_DATA / name), str(tmp_path / "out"), to)
    src, s_tensors, s_objects = read_all(MOE_DATA / name)
    out, o_tensors, o_objects = read_all(tmp_path / "out")
    assert out.index.world_size == dp
    assert out.index.metadata["parallel"] == {"ep": ep, "dp": dp}
    assert out.index.metadata["deepspeed_moe"] == {
        "ep_size": ep,
        "expert_dp_size": dp // ep,
        "num_experts": _expert_counts(name),
    }
    assert set(o_tensors) == set(s_tensors)
    for key, value in s_tensors.items():
        assert_tensor_equal(o_tensors[key], value, key)
    counts = _expert_counts(name)
    experts = 0
    for key, entry in out.index.tensors.items():
        prefix, marked, tail = key.partition(MARK)
        if marked:
            layer = prefix.rsplit(".", 1)[-1]  # model.moe2, ds_module.moe, optim.state.moe
            expert = int(tail.split(".")[0])
            assert entry.attrs["parallel"] == {"ep": {"rank": expert // (counts[layer] // ep), "size": ep}}, key
            experts += 1
        else:
            assert "parallel" not in entry.attrs, key
    assert experts > 0
    steps = [k for k in s_objects if k.startswith("optim.state.") and k.endswith(".step")]
    assert steps and all(o_objects[k] == s_objects[k] for k in steps)
    for key in ("ds.global_steps", "ds.num_experts", "client.epoch", "ds.lr_scheduler"):
        if key in s_objects:
            assert o_objects[key] == s_objects[key], key
    assert o_objects["ds.dp_world_size"] == dp
    groups = [g for g in range(16) if f"optim.param_groups.{g}.name" in o_objects]
    names = {o_objects[f"optim.param_groups.{g}.name"] for g in groups if o_objects.get(f"optim.param_groups.{g}.moe")}
    assert len(groups) == 4 and names == {f"ep_size_{ep}"}
    tag = tmp_path / "out" / "global_step2"
    for f in (MOE_DATA / name / "global_step2").glob("layer_*_expert_*"):  # copied byte for byte
        assert (tag / f.name).read_bytes() == f.read_bytes(), f.name
    prefix = "bf16_" if _moe_info(name)["dtype"] == "bf16" else ""
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == sorted(
        f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp)
    )


# the "type" fixture's partition_method and its layers' class names (fixtures/generate_ds_pp.py
# TYPE_METHOD, LAYER_TYPES): FrozenBlock and LayerNorm weigh 1, stages [0, 4, 6] at pp 2
TYPE = "type:layernorm|frozen"
LAYER_TYPES = "Embed,Block,FrozenBlock,Block,LayerNorm,Embed"

# (fixture, --to, --partition-method, (pp, dp), stage boundaries DeepSpeed gives its 6 layers)
PP_TARGETS = [
    ("pp2_dp2_z1_fp32", "pp=1,dp=1", "uniform", (1, 1), [0, 6]),
    ("pp2_dp2_z1_fp32", "pp=1,dp=3", "uniform", (1, 3), [0, 6]),
    ("pp2_dp2_z1_fp32", "pp=2,dp=1", "parameters", (2, 1), [0, 3, 6]),
    ("pp2_dp2_z1_fp32", "pp=3,dp=2", "uniform", (3, 2), [0, 2, 4, 6]),
    ("pp2_dp2_z1_fp32", "pp=4,dp=1", "parameters", (4, 1), [0, 1, 3, 5, 6]),
    ("pp2_dp2_z1_fp32", "pp=4,dp=3", "uniform", (4, 3), [0, 2, 4, 5, 6]),
    ("pp2_dp2_z1_fp32", "pp=6,dp=1", "uniform", (6, 1), [0, 1, 2, 3, 4, 5, 6]),
    ("pp2_dp2_z1_fp32", "6", "uniform", (2, 3), [0, 3, 6]),
    ("pp2_dp2_z1_bf16", "pp=1,dp=2", "uniform", (1, 2), [0, 6]),
    ("pp2_dp2_z1_bf16", "pp=3,dp=3", "parameters", (3, 3), [0, 2, 4, 6]),
    ("pp2_dp2_z1_fp16", "pp=4,dp=2", "uniform", (4, 2), [0, 2, 4, 5, 6]),
    ("pp2_dp1_z1_fp32_tiedhead", "pp=3,dp=1", "uniform", (3, 1), [0, 2, 4, 6]),
    ("pp2_dp2_z1_fp32_mptopo", "pp=1,dp=2", "uniform", (1, 2), [0, 6]),
    ("pp2_dp2_z0_bf16", "pp=1,dp=3", "uniform", (1, 3), [0, 6]),
    ("pp2_dp2_z0_bf16", "pp=3,dp=1", "parameters", (3, 1), [0, 2, 4, 6]),
    ("pp2_dp1_z1_fp32_type", "pp=3,dp=1", TYPE, (3, 1), [0, 4, 5, 6]),
    ("pp2_dp1_z1_fp32_type", "pp=4,dp=2", TYPE, (4, 2), [0, 3, 4, 5, 6]),
    ("pp2_dp1_z1_fp32_type", "pp=1,dp=2", TYPE, (1, 2), [0, 6]),
    ("pp2_dp2_z1_fp32", "pp=3,dp=1", "type:block", (3, 1), [0, 2, 3, 6]),  # Block, FrozenBlock: [0, 3, 6] at pp 2
]


def _pp_files(name: str, pp: int, dp: int) -> list[str]:
    src = PP_DATA / name / "global_step2"
    layers = sorted(p.name for p in src.glob("layer_*"))
    prefix = "bf16_" if any(src.glob("bf16_*")) else ""
    return sorted(
        layers
        + [f"mp_rank_{s:02d}_model_states.pt" for s in range(pp)]
        + [f"{prefix}zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for s in range(pp) for d in range(dp)]
    )


def _pp_reads_back(tmp_path, name, to, method, sizes, parts):
    pp, dp = sizes
    types = ["--layer-types", LAYER_TYPES] if method.startswith("type:") else []
    res = run_cli("reshard", PP_DATA / name, tmp_path / "out", "--to", to, "--partition-method", method, *types)
    assert res.code == 0, res.output
    _, want, _ = read_all(PP_DATA / name)
    opened, got, objects = read_all(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for key in want:
        assert_tensor_equal(got[key], want[key], key)
    index = opened.index
    assert index.world_size == pp * dp and index.metadata["parallel"] == {"pp": pp, "dp": dp}
    layers = index.metadata["deepspeed"]["pipeline"]["layers"]  # layer -> stage, as read back
    assert all(parts[s] <= int(layer) < parts[s + 1] for layer, s in layers.items()), (layers, parts)
    assert objects["ds.mp_world_size"] == pp and objects["ds.dp_world_size"] == dp
    assert objects["ds.checkpoint_parallel_dimensions"]["pp_degree"] == pp
    assert sorted(p.name for p in (tmp_path / "out" / "global_step2").iterdir()) == _pp_files(name, pp, dp)
    for f in (PP_DATA / name / "global_step2").glob("layer_*"):  # a layer's own state: copied byte for byte
        assert (tmp_path / "out" / "global_step2" / f.name).read_bytes() == f.read_bytes()


def _moe_tp_truth(name):
    return torch.load(MT_DATA / f"{name}.truth.pt", weights_only=True)


def _params(truth) -> list[str]:
    return [k[len("fp32.") :] for k in truth if k.startswith("fp32.")]


def _equal_to_truth(tensors: dict, truth: dict) -> int:
    compared = 0
    for p in _params(truth):
        assert_tensor_equal(tensors[f"model.{p}"], truth[f"fp32.{p}"], p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(tensors[f"optim.state.{p}.{key}"], truth[f"{key}.{p}"], f"{p}.{key}")
        assert_tensor_equal(tensors[f"ds_module.{p}"], truth[f"module.{p}"], f"module {p}")
        compared += 1
    return compared


# (fixture, --to, (tp, ep, dp)): tp merged away / grown, ep merged / split, dp grown; a world size
TP_EP_SLICED_TARGETS = [
    ("moetp_z2_fp32_tp2_ep2_w4", "tp=1,ep=2,dp=4", (1, 2, 4)),
    ("moetp_z2_fp32_tp2_ep2_w4", "tp=4,ep=1,dp=1", (4, 1, 1)),
    ("moetp_z2_fp32_tp2_ep2_w4", "tp=2,ep=4,dp=4", (2, 4, 4)),
    ("moetp_z2_fp32_tp2_ep2_w4", "8", (2, 2, 4)),
    ("moetp_z1_bf16_tp2_ep2_w4", "tp=1,ep=4,dp=4", (1, 4, 4)),
    ("moetp_z1_bf16_tp2_ep2_w4", "tp=2,ep=1,dp=3", (2, 1, 3)),
    ("moetp_z2_fp32_tp2_ep2_w8", "tp=1,ep=2,dp=2", (1, 2, 2)),
    ("moetp_z2_fp32_tp2_ep2_w8", "tp=4,ep=4,dp=4", (4, 4, 4)),
]


def _tp_ep_sliced_reads_back(tmp_path, name, to, sizes):
    tp, ep, dp = sizes
    res = _cli("reshard", MT_DATA / name, tmp_path / "out", "--to", to)
    assert res.exit_code == 0, res.output
    opened, tensors, objects = read_all(tmp_path / "out")
    _equal_to_truth(tensors, _moe_tp_truth(name))
    assert opened.index.metadata["parallel"] == ({"tp": tp} if tp > 1 else {}) | {"ep": ep, "dp": dp}
    assert objects["ds.mp_world_size"] == tp and objects["ds.dp_world_size"] == dp
    prefix = "bf16_" if "bf16" in name else ""
    assert sorted(p.name for p in (tmp_path / "out" / "global_step2").iterdir()) == sorted(
        [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]
        + [f"layer_0_expert_{e}_mp_rank_{t:02d}_model_states.pt" for t in range(tp) for e in range(4)]
        + [f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for t in range(tp) for d in range(dp)]
    )


# whole experts (enable_expert_tensor_parallelism=False) at new sizes: (--to, (tp, ep, dp)); tp
# grown with ep (4, 4), ep beyond tp (ep 4 at tp 2), a world size with dp 3, tp merged away (a plain
# MoE checkpoint)
TP_EP_WHOLE_TARGETS = [
    ("moetp_noexptp_z2_fp32_tp2_ep2_w4", "tp=4,ep=4,dp=1", (4, 4, 1)),
    ("moetp_noexptp_z2_fp32_tp2_ep2_w4", "tp=2,ep=4,dp=2", (2, 4, 2)),
    ("moetp_noexptp_z2_fp32_tp2_ep2_w4", "6", (2, 2, 3)),
    ("moetp_noexptp_z2_fp32_tp2_ep2_w4", "tp=1,ep=2,dp=2", (1, 2, 2)),
    ("moetp_noexptp_z1_bf16_tp2_ep2_w4", "tp=1,ep=4,dp=4", (1, 4, 4)),
    ("moetp_noexptp_z1_bf16_tp2_ep2_w4", "tp=4,ep=4,dp=2", (4, 4, 2)),
]


def _tp_ep_whole_reads_back(tmp_path, name, to, sizes):
    """Each expert file under the mp rank that saves it at the new sizes (ep rank e's: e % tp),
    copied; the dense groups over dp within each tp lane, the expert groups over tp x dp / ep."""
    tp, ep, dp = sizes
    res = _cli("reshard", MT_DATA / name, tmp_path / "out", "--to", to)
    assert res.exit_code == 0, res.output
    opened, tensors, objects = read_all(tmp_path / "out")
    assert _equal_to_truth(tensors, _moe_tp_truth(name)) == 28
    assert opened.index.metadata["parallel"] == ({"tp": tp} if tp > 1 else {}) | {"ep": ep, "dp": dp}
    assert opened.index.metadata["deepspeed_moe"]["expert_dp_size"] == tp * dp // ep
    assert objects["ds.mp_world_size"] == tp and objects["ds.dp_world_size"] == dp
    local, prefix = 4 // ep, "bf16_" if "bf16" in name else ""
    assert sorted(p.name for p in (tmp_path / "out" / "global_step2").iterdir()) == sorted(
        [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]
        + [f"layer_0_expert_{g}_mp_rank_{(g // local) % tp:02d}_model_states.pt" for g in range(4)]
        + [f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for t in range(tp) for d in range(dp)]
    )


PP_MOE = "ppmoe_z1_fp32_pp2_ep2_w4"
PP_MOE4 = "ppmoe_z1_fp32_pp2_ep2_w4_moe4"  # Embed, MoEBlock*2 | MoEBlock*2, Head: MoE layer ids 0, 1 per stage

PP_EP_TARGETS = [("pp=2,ep=1,dp=3", (1, 3)), ("pp=2,ep=4,dp=4", (4, 4)), ("8", (2, 4))]
PP_EP_ONE_STAGE_TARGETS = [("pp=1,ep=2,dp=2", 2, 2), ("pp=1,ep=1,dp=3", 1, 3), ("pp=1,ep=4,dp=4", 4, 4)]
PP_EP_MOVED_TARGETS = [
    ("pp=3,ep=2,dp=2", "uniform", [["1.moe"], ["2.moe", "3.moe"], ["4.moe"]]),  # uniform: [0, 2, 4, 6]
    ("pp=4,ep=2,dp=4", "parameters", [["1.moe"], ["2.moe"], ["3.moe"], ["4.moe"]]),
    ("pp=4,ep=1,dp=1", "parameters", [["1.moe"], ["2.moe"], ["3.moe"], ["4.moe"]]),
    ("pp=1,ep=4,dp=4", "parameters", [["1.moe", "2.moe", "3.moe", "4.moe"]]),
]


def _pp_moe_truth(name):
    return torch.load(PM_DATA / f"{name}.truth.pt", weights_only=True)


def _pp_ep_reads_back(tmp_path, name, to, sizes):
    ep, dp = sizes
    res = _cli("reshard", PM_DATA / name, tmp_path / "out", "--to", to)
    assert res.exit_code == 0, res.output
    truth = _pp_moe_truth(name)
    opened, tensors, objects = read_all(tmp_path / "out")
    for p in _params(truth):
        assert_tensor_equal(tensors[f"model.{p}"], truth[f"fp32.{p}"], p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(tensors[f"optim.state.{p}.{key}"], truth[f"{key}.{p}"], f"{p}.{key}")
        assert_tensor_equal(tensors[f"ds_module.{p}"], truth[f"module.{p}"], f"module {p}")
    assert opened.index.metadata["parallel"] == {"pp": 2, "ep": ep, "dp": dp}
    assert sorted(p.name for p in (tmp_path / "out" / "global_step2").iterdir()) == sorted(
        [f"mp_rank_{s:02d}_model_states.pt" for s in range(2)]
        + [f"layer_0_expert_{e}_mp_rank_{s:02d}_model_states.pt" for s in range(2) for e in range(4)]
        + [f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for s in range(2) for d in range(dp)]
    )


def _pp_ep_one_stage_reads_back(tmp_path, name, to, ep, dp):
    """pp 2 -> 1: the one stage holds both MoE layers, 1.moe as layer 0 and 2.moe as layer 1 (source:
    layer 0 of stages 0 and 1); read back as a plain MoE checkpoint equal to the truth."""
    res = _cli("reshard", PM_DATA / name, tmp_path / "out", "--to", to)
    assert res.exit_code == 0, res.output
    truth = _pp_moe_truth(name)
    opened, tensors, _ = read_all(tmp_path / "out")
    for p in _params(truth):
        assert_tensor_equal(tensors[f"model.{p}"], truth[f"fp32.{p}"], p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(tensors[f"optim.state.{p}.{key}"], truth[f"{key}.{p}"], f"{p}.{key}")
        assert_tensor_equal(tensors[f"ds_module.{p}"], truth[f"module.{p}"], f"module {p}")
    assert opened.index.metadata["deepspeed_moe"]["num_experts"] == {"1.moe": 4, "2.moe": 4}
    tag = tmp_path / "out" / "global_step2"
    assert sorted(p.name for p in tag.iterdir()) == sorted(
        ["mp_rank_00_model_states.pt"]
        + [f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in range(dp)]
        + [f"layer_{L}_expert_{e}_mp_rank_00_model_states.pt" for L in range(2) for e in range(4)]
    )
    for L, moe in enumerate(("1.moe", "2.moe")):
        keys = torch.load(tag / f"layer_{L}_expert_3_mp_rank_00_model_states.pt", weights_only=True)
        assert all(k.startswith(f"{moe}.deepspeed_moe.experts.deepspeed_experts.3.") for k in keys), keys
    model = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)  # trusted: our output
    assert model["num_experts"] == [4, 4] and model["checkpoint_parallel_dimensions"]["pp_degree"] == 1
    assert list(model["module"]) == [
        "0.e.weight",
        "1.moe.deepspeed_moe.gate.wg.weight",
        "2.moe.deepspeed_moe.gate.wg.weight",
        "3.h.weight",
        "3.h.bias",
    ]


def _pp_ep_moved_moe_layers_read_back(tmp_path, name, to, method, stages):
    """Each new stage's expert files count its own MoE layers from 0 (layer_<L>_..._mp_rank_<stage>),
    holding the global names they held before; reads back equal to the truth."""
    res = _cli("reshard", PM_DATA / name, tmp_path / "out", "--to", to, "--partition-method", method)
    assert res.exit_code == 0, res.output
    truth = torch.load(PM_DATA / f"{name}.truth.pt", weights_only=True)
    opened, tensors, _ = read_all(tmp_path / "out")
    for p in _params(truth):
        assert_tensor_equal(tensors[f"model.{p}"], truth[f"fp32.{p}"], p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(tensors[f"optim.state.{p}.{key}"], truth[f"{key}.{p}"], f"{p}.{key}")
    tag = tmp_path / "out" / "global_step2"
    experts = sorted(p.name for p in tag.iterdir() if p.name.startswith("layer_"))
    assert experts == sorted(
        f"layer_{L}_expert_{e}_mp_rank_{s:02d}_model_states.pt"
        for s, moes in enumerate(stages)
        for L in range(len(moes))
        for e in range(4)
    )
    for s, moes in enumerate(stages):
        for L, moe in enumerate(moes):
            keys = torch.load(tag / f"layer_{L}_expert_2_mp_rank_{s:02d}_model_states.pt", weights_only=True)
            assert keys and all(k.startswith(f"{moe}.deepspeed_moe.experts.deepspeed_experts.2.") for k in keys)
        model = torch.load(tag / f"mp_rank_{s:02d}_model_states.pt", weights_only=False)  # trusted: our output
        assert model["num_experts"] == [4] * len(moes) and model["mp_world_size"] == len(stages)


INDEX_KEY = {
    "fp32": "model.{}",
    "exp_avg": "optim.state.{}.exp_avg",
    "exp_avg_sq": "optim.state.{}.exp_avg_sq",
    "module": "ds_module.{}",
}


def _d3_truth(name: str) -> dict:
    return torch.load(D3 / f"{name}.truth.pt", weights_only=True)


PP_TP_DP_TARGETS = [
    "tp=2,pp=2,dp=1",
    "tp=2,pp=2,dp=2",
    "tp=1,pp=2,dp=2",
    "tp=4,pp=1,dp=2",
    "tp=1,pp=1,dp=1",
    "tp=2,pp=1,dp=3",
    "tp=2,pp=3,dp=1",
]


def _pp_tp_dp_reads_back(tmp_path, name, to):
    """reshard --to tp=T,pp=P,dp=W: DeepSpeed's file names at the new sizes, and read back every
    master, Adam moment and module weight equals DeepSpeed's truth, with the new splits and stages."""
    truth = _d3_truth(name)
    res = run_cli("reshard", D3 / name, tmp_path / "out", "--to", to, "--partition-method", "uniform")
    assert res.code == 0, res.output
    sizes = dict(part.split("=") for part in to.split(","))
    tp, pp, dp = int(sizes["tp"]), int(sizes["pp"]), int(sizes["dp"])
    tag = tmp_path / "out" / "global_step2"
    names = sorted(p.name for p in tag.iterdir())
    prefix = "bf16_" if name.endswith("bf16") else ""
    expect = sorted(
        [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(5) for t in range(tp)]
        + [f"mp_rank_{m:02d}_model_states.pt" for m in range(pp * tp)]
        + [f"{prefix}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in range(dp) for m in range(pp * tp)]
    )
    assert names == expect
    back, tensors, objects = read_all(tmp_path / "out")
    assert back.index.metadata["parallel"] == ({"pp": pp, "tp": tp, "dp": dp} if tp > 1 else {"pp": pp, "dp": dp})
    compared = 0
    for key, expected in truth.items():
        kind, _, pname = key.partition(".")
        if kind in INDEX_KEY:
            assert_tensor_equal(tensors[INDEX_KEY[kind].format(pname)], expected, key)
            compared += 1
    assert compared == 4 * 28
    assert objects["ds.global_steps"] == 2


# family -> (fixture folder, check, [(fixture, --to, what the check expects), ...])
RESHARD_FAMILIES = {
    "tp": (TP_DATA, _tp_reads_back, [(n, to, (sizes,)) for n, to, sizes in TP_TARGETS]),
    "ep": (MOE_DATA, _ep_reads_back, [(n, to, (sizes,)) for n, to, sizes in EP_TARGETS]),
    "pp": (PP_DATA, _pp_reads_back, [(n, to, (m, sizes, parts)) for n, to, m, sizes, parts in PP_TARGETS]),
    "tp_ep_sliced": (MT_DATA, _tp_ep_sliced_reads_back, [(n, to, (s,)) for n, to, s in TP_EP_SLICED_TARGETS]),
    "tp_ep_whole": (MT_DATA, _tp_ep_whole_reads_back, [(n, to, (s,)) for n, to, s in TP_EP_WHOLE_TARGETS]),
    "pp_ep": (PM_DATA, _pp_ep_reads_back, [(PP_MOE, to, (sizes,)) for to, sizes in PP_EP_TARGETS]),
    "pp_ep_one_stage": (
        PM_DATA,
        _pp_ep_one_stage_reads_back,
        [(PP_MOE, to, (ep, dp)) for to, ep, dp in PP_EP_ONE_STAGE_TARGETS],
    ),
    "pp_ep_moved_layers": (
        PM_DATA,
        _pp_ep_moved_moe_layers_read_back,
        [(PP_MOE4, to, (m, stages)) for to, m, stages in PP_EP_MOVED_TARGETS],
    ),
    "pp_tp_dp": (
        D3,
        _pp_tp_dp_reads_back,
        [(n, to, ()) for n in ["pp2_tp2_dp2_z1_fp32", "pp2_tp2_dp1_z1_bf16"] for to in PP_TP_DP_TARGETS],
    ),
}


def _reshard_cases() -> list:
    cases = []
    for family, (folder, _, targets) in RESHARD_FAMILIES.items():
        for name, to, expected in targets:
            reason = f"fixture {folder.name}/{name} missing (run fixtures/generate_*.py)"
            marks = [] if (folder / name).is_dir() else [pytest.mark.skip(reason=reason)]
            cases.append(pytest.param(family, name, to, expected, marks=marks, id=f"{family}/{name}/{to}"))
    return cases


@pytest.mark.parametrize("family,name,to,expected", _reshard_cases())
def test_reshard_reads_back_equal_to_the_truth(tmp_path, family, name, to, expected):
    """reshard --to the target: every tensor read back equal to the truth, DeepSpeed's file names at the
    new sizes, and the sizes recorded (each family's check says what else its layout must show)."""
    _, check, _ = RESHARD_FAMILIES[family]
    check(tmp_path, name, to, *expected)
