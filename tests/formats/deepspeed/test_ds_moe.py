"""DeepSpeed mixture-of-experts checkpoints (deepspeed.moe.layer.MoE, 4 experts, ep_size 2, ZeRO 1/2)
read, consolidated and converted bit for bit against the truth DeepSpeed's own API gave at save time
(safe_get_full_fp32_param / safe_get_full_optimizer_state on every rank, local experts renamed to
their global ids): fixtures/generate_ds_moe.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptkit.ops.consolidate import consolidate
from conftest import DATA, assert_tensor_equal, read_all, subprocess_env
from helpers.ds_fixtures import needs_deepspeed

MOE_DATA = DATA / "ds_moe"
FIXTURES = sorted(p.name for p in MOE_DATA.glob("moe*") if p.is_dir()) if MOE_DATA.is_dir() else []
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no MoE fixtures (run fixtures/generate_ds_moe.py)")
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts."


def _truth(name):
    return torch.load(MOE_DATA / f"{name}.truth.pt", weights_only=True)


def _info(name):
    return json.loads((MOE_DATA / name / "fixture.json").read_text())


def _params(truth) -> list[str]:
    return [k[len("fp32.") :] for k in truth if k.startswith("fp32.")]


def test_fixtures_cover_both_expert_dp_sizes():
    """World 2 (expert-dp 1) and world 4 (expert-dp 2: expert groups partitioned over 2 ranks)."""
    assert {_info(n)["expert_dp_size"] for n in FIXTURES} == {1, 2}
    assert {_info(n)["stage"] for n in FIXTURES} == {1, 2}


@pytest.mark.parametrize("name", FIXTURES)
def test_rank_to_expert_groups_as_deepspeed_made_them(name):
    """moe.py's rank r = ep rank r % E, expert-dp rank r // E: what DeepSpeed's groups reported."""
    from ckptkit.formats.deepspeed.moe import ExpertLayout

    info = _info(name)
    layout = ExpertLayout(ep=info["ep_size"], world=info["world_size"], layers={"moe": info["num_experts"]})
    for rank, seen in info["ranks"].items():
        assert layout.rank(seen["ep_rank"], seen["expert_dp_rank"]) == int(rank)


@pytest.mark.parametrize("name", FIXTURES)
def test_reader_equals_deepspeed_truth(name):
    info, truth = _info(name), _truth(name)
    opened, tensors, objects = read_all(MOE_DATA / name)
    index = opened.index
    params = _params(truth)
    experts = [4] + ([info["second_moe_experts"]] if info.get("second_moe_experts") else [])
    assert sum(1 for p in params if ".deepspeed_experts." in p) == 4 * sum(experts)  # 4 params per expert
    compared = 0
    for pname in params:
        assert_tensor_equal(tensors[f"model.{pname}"], truth[f"fp32.{pname}"], pname)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(tensors[f"optim.state.{pname}.{key}"], truth[f"{key}.{pname}"], f"{pname}.{key}")
        assert objects[f"optim.state.{pname}.step"] == truth[f"step.{pname}"]
        assert_tensor_equal(tensors[f"ds_module.{pname}"], truth[f"module.{pname}"], f"module {pname}")
        compared += 1
    assert compared == len(params) == len([k for k in index.tensors if k.startswith("model.")])
    assert index.metadata["parallel"] == {"ep": 2, "dp": info["world_size"]}
    for prefix, count in zip(("moe", "moe2"), experts):
        for e in range(count):
            for kind in ("model", "ds_module"):
                entry = index.tensors[f"{kind}.{prefix}.deepspeed_moe.experts.deepspeed_experts.{e}.fc1.weight"]
                assert entry.attrs["parallel"] == {"ep": {"rank": e // (count // 2), "size": 2}}
    assert "parallel" not in index.tensors["model.moe.deepspeed_moe.gate.wg.weight"].attrs
    assert objects["ds.global_steps"] == truth["global_steps"] == 2
    assert objects["ds.num_experts"] == experts and "client.num_experts" not in objects
    moe_groups = [g for g in range(4) if objects.get(f"optim.param_groups.{g}.moe")]
    listed = [n for g in moe_groups for n in objects[f"optim.param_groups.{g}.params"]]
    assert sorted(listed) == sorted(p for p in params if ".deepspeed_experts." in p)


@pytest.mark.parametrize("name", FIXTURES)
def test_consolidate_every_expert_bit_exact(tmp_path, name):
    truth = _truth(name)
    consolidate(str(MOE_DATA / name), str(tmp_path / "out"), include_optimizer=True)
    model = load_file(str(tmp_path / "out" / "model.safetensors"))
    optim = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    assert set(model) == set(_params(truth))
    for pname in _params(truth):
        assert_tensor_equal(model[pname], truth[f"fp32.{pname}"], pname)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(optim[f"state.{pname}.{key}"], truth[f"{key}.{pname}"], f"{pname}.{key}")


def _cli(*args):
    from ckptkit_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def test_convert_to_torch_and_dcp_through_the_canonical_index(tmp_path):
    name = "moe_z2_fp32_w4_k1" if "moe_z2_fp32_w4_k1" in FIXTURES else FIXTURES[0]
    truth = _truth(name)
    res = _cli("convert", MOE_DATA / name, tmp_path / "t.pt", "--to", "torch")
    assert res.exit_code == 0, res.output
    saved = torch.load(tmp_path / "t.pt", weights_only=True)
    for pname in _params(truth):
        assert_tensor_equal(saved["model"][pname], truth[f"fp32.{pname}"], pname)
        assert_tensor_equal(saved["optim"]["state"][pname]["exp_avg_sq"], truth[f"exp_avg_sq.{pname}"], pname)
    res = _cli("convert", MOE_DATA / name, tmp_path / "dcp", "--to", "dcp")
    assert res.exit_code == 0, res.output
    _, tensors, _ = read_all(tmp_path / "dcp")
    for pname in _params(truth):
        assert_tensor_equal(tensors[f"model.{pname}"], truth[f"fp32.{pname}"], pname)


def test_verify_diff_and_plan(tmp_path):
    a, b = (MOE_DATA / n for n in (FIXTURES[0], FIXTURES[0]))
    res = _cli("verify", a)
    assert res.exit_code == 0 and "structure sound" in res.output, res.output
    res = _cli("diff", a, b)
    assert res.exit_code == 0, res.output
    other = MOE_DATA / next(n for n in FIXTURES if n != FIXTURES[0])
    res = _cli("diff", a, other)
    assert res.exit_code == 1 and "deepspeed_experts" in res.output, res.output
    res = _cli("plan", a)
    assert res.exit_code == 0 and "optim_states.pt" in res.output, res.output


def _copy(tmp_path, name="moe_z2_fp32_w4_k1"):
    name = name if name in FIXTURES else FIXTURES[-1]
    dst = tmp_path / name
    shutil.copytree(MOE_DATA / name, dst)
    return dst, dst / "global_step2"


def _one_sentence_exit_2(res, *needles):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    line = res.output.strip().splitlines()[-1]
    for needle in needles:
        assert needle in line, line


def test_missing_expert_file(tmp_path):
    src, tag = _copy(tmp_path)
    (tag / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    _one_sentence_exit_2(
        _cli("consolidate", src, tmp_path / "o"),
        "layer_0_expert_3_mp_rank_00_model_states.pt",
        "expert file is missing",
        "4 experts",
    )


def test_expert_file_with_the_wrong_shape(tmp_path):
    src, tag = _copy(tmp_path)
    path = tag / "layer_0_expert_1_mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state[f"{EXPERT}1.fc1.weight"] = torch.zeros(12, 7)
    torch.save(state, path)
    _one_sentence_exit_2(
        _cli("consolidate", src, tmp_path / "o"), "layer_0_expert_1", f"{EXPERT}1.fc1.weight", "[12, 7]", "[12, 8]"
    )


@pytest.mark.parametrize(
    "rank,needle",
    [(1, "optim-states files for rank(s) [1] are missing"), (3, "zero_pp_rank_3_mp_rank_00_optim_states.pt")],
)
def test_missing_rank_optim_file(tmp_path, rank, needle):
    src, tag = _copy(tmp_path)
    (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").unlink()
    _one_sentence_exit_2(_cli("consolidate", src, tmp_path / "o"), needle)


@pytest.mark.parametrize("args", [("convert", "--to", "zero2")])  # reshard: test_ds_moe_reshard.py
def test_converting_to_zero_is_refused(tmp_path, args):
    command, *rest = args
    res = _cli(command, MOE_DATA / FIXTURES[0], tmp_path / "o", *rest)
    _one_sentence_exit_2(res, "mixture-of-experts", "not supported yet", "--to ep=")
    assert not (tmp_path / "o").exists()


def test_autoep_checkpoint_is_refused(tmp_path):
    """AutoEP experts (fused experts.w1/w2/w3, recorded in ds_autoep_layers) are another layout."""
    src, tag = _copy(tmp_path)
    path = tag / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)  # our own fixture, re-saved with one value changed
    state["ds_autoep_layers"] = [{"moe_layer_id": 0, "module_path": "moe", "num_experts": 4, "ep_size": 2}]
    torch.save(state, path)
    _one_sentence_exit_2(_cli("inspect", src), "AutoEP", "not supported yet")


LOAD_STRICT = r"""
import sys
sys.path.insert(0, "fixtures")
from safetensors.torch import load_file
import generate_ds_moe as g
second = int(sys.argv[3]) or None
model = g.build_model(k=int(sys.argv[2]), ep_rank=0, ep_size=1, second_moe=second)   # one process, all experts
model.load_state_dict(load_file(sys.argv[1]), strict=True)
print("loaded", sum(1 for _ in model.parameters()), "of", len(load_file(sys.argv[1])))
"""


@needs_deepspeed
@pytest.mark.parametrize("name", [n for n in ("moe_z2_fp32_w4_k1", "moe2_z2_fp32_w2_k1") if n in FIXTURES])
def test_consolidated_experts_load_strictly_into_the_model_with_all_experts(tmp_path, name):
    """The consolidated names and shapes are the model's own: DeepSpeed's MoE layer built with
    ep_size 1 (every expert in one process, under its global id) takes them with strict=True."""
    import subprocess
    import sys

    consolidate(str(MOE_DATA / name), str(tmp_path / "out"))
    env = {**subprocess_env(), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_STRICT,
            str(tmp_path / "out" / "model.safetensors"),
            str(_info(name)["k"]),
            str(_info(name).get("second_moe_experts") or 0),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(DATA.parent.parent),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    count = len(_params(_truth(name)))
    assert f"loaded {count} of {count}" in proc.stdout, proc.stdout
