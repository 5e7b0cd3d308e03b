"""A DeepSpeed MoE model inside a PipelineModule (pp=2 x dp=2, ep=2, ZeRO 1, fp32):
fixtures/generate_ds_pp_moe.py. DeepSpeed 0.19.8 saves it as one MoE checkpoint per stage under
mp_rank_<stage> (no layer files); join_pp.py joins the stages. Read and consolidated bit for
bit against the truth of safe_get_full_fp32_param / safe_get_full_optimizer_state; `inspect` shows
pp and ep. reshard at a new ep and dp, the stages kept (split_pp.py, moe_stages.py), reads back equal,
is DeepSpeed's own files at the same sizes (both in test_layout_matrix.py, as are the new-pp reads).
At a new pp (2 -> 1) the layers move, the per-stage MoE layer ids of the expert files are
renumbered. DeepSpeed loading pp=2,ep=1,dp=2 and pp=1,ep=2,dp=2 (every master, moment and module
weight bit for bit, a train_batch; what it saves from the second our output object for object):
test_ds_engine_matrix.py. A new pp that leaves a stage without MoE, and other sizes that cannot be
written, are refused in one sentence."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptkit.ops.consolidate import consolidate
from conftest import DATA, assert_tensor_equal, read_all

PM_DATA = DATA / "ds_pp_moe"
NAME = "ppmoe_z1_fp32_pp2_ep2_w4"
pytestmark = pytest.mark.skipif(not (PM_DATA / NAME).is_dir(), reason="run fixtures/generate_ds_pp_moe.py")


def _truth():
    return torch.load(PM_DATA / f"{NAME}.truth.pt", weights_only=True)


def _params(truth) -> list[str]:
    return [k[len("fp32.") :] for k in truth if k.startswith("fp32.")]


def _cli(*args):
    from ckptkit_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def test_fixture_is_the_moe_layout_per_stage():
    """What DeepSpeed wrote: MoE files under mp_rank_<stage>, no PipelineModule layer files."""
    info = json.loads((PM_DATA / NAME / "fixture.json").read_text())
    assert not [f for f in info["files"] if f.startswith("layer_") and "-model_" in f]
    assert {f"mp_rank_{s:02d}_model_states.pt" for s in range(2)} <= set(info["files"])


def test_reader_equals_deepspeed_truth_with_pp_and_ep_marked():
    truth = _truth()
    opened, tensors, objects = read_all(PM_DATA / NAME)
    index = opened.index
    params = _params(truth)
    for p in params:
        assert_tensor_equal(tensors[f"model.{p}"], truth[f"fp32.{p}"], p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(tensors[f"optim.state.{p}.{key}"], truth[f"{key}.{p}"], f"{p}.{key}")
        assert_tensor_equal(tensors[f"ds_module.{p}"], truth[f"module.{p}"], f"module {p}")
    assert len(params) == len([k for k in index.tensors if k.startswith("model.")]) == 37
    assert index.metadata["parallel"] == {"pp": 2, "ep": 2, "dp": 2}
    assert index.metadata["deepspeed_moe"]["num_experts"] == {"1.moe": 4, "2.moe": 4}
    expert = index.tensors["model.2.moe.deepspeed_moe.experts.deepspeed_experts.3.fc1.weight"]
    assert expert.attrs["parallel"] == {"ep": {"rank": 1, "size": 2}, "pp": {"stage": 1, "size": 2}}
    assert index.tensors["model.0.e.weight"].attrs["parallel"] == {"pp": {"stage": 0, "size": 2}}
    listed = [n for g in range(4) for n in objects.get(f"optim.param_groups.{g}.params", [])]
    assert sorted(listed) == sorted(params)
    assert objects["ds.global_steps"] == truth["global_steps"] == 2


def test_consolidate_with_optimizer_bit_exact(tmp_path):
    truth = _truth()
    consolidate(str(PM_DATA / NAME), str(tmp_path / "out"), include_optimizer=True)
    model = load_file(str(tmp_path / "out" / "model.safetensors"))
    optim = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    assert set(model) == set(_params(truth))
    for p in _params(truth):
        assert_tensor_equal(model[p], truth[f"fp32.{p}"], p)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(optim[f"state.{p}.{key}"], truth[f"{key}.{p}"], f"{p}.{key}")


def test_inspect_shows_pp_and_ep():
    res = _cli("inspect", PM_DATA / NAME)
    assert res.exit_code == 0, res.output
    assert "pp 2 x ep 2 x dp 2" in res.output and "pp stage 1/2" in res.output


@pytest.mark.parametrize(
    "args,needle",
    [
        (["reshard", "--to", "pp=3,ep=2,dp=2"], "new pipeline stage 2 (layers 3..3) would hold no MoE layer"),
        (["reshard", "--to", "pp=4,ep=2,dp=2", "--partition-method", "uniform"], "would hold no MoE layer"),
        (["reshard", "--to", "pp=5,ep=2,dp=2"], "has 4 layers, fewer than the 5 pipeline stages"),
        (
            [
                "reshard",
                "--to",
                "pp=1,ep=2,dp=2",
                "--partition-method",
                "type:Head",
                "--layer-types",
                "Embed,MoEBlock*2,Head",
            ],
            "do not split into its 2 stages",
        ),
        (["reshard", "--to", "pp=2,ep=3,dp=3"], "has 4 experts"),
        (["reshard", "--to", "tp=2,pp=2,ep=2,dp=2"], "tensor parallelism"),
        (["convert", "--to", "zero2"], "mixture-of-experts"),
    ],
)
def test_sizes_that_cannot_be_written_are_refused_in_one_sentence(tmp_path, args, needle):
    res = _cli(args[0], PM_DATA / NAME, tmp_path / "out", *args[1:])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    assert needle in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_pp_degree_that_lies_is_one_sentence(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(PM_DATA / NAME, src)
    for s in range(2):
        path = src / "global_step2" / f"mp_rank_{s:02d}_model_states.pt"
        obj = torch.load(path, weights_only=False)  # trusted: a copy of our own fixture
        obj["checkpoint_parallel_dimensions"]["pp_degree"] = 3
        torch.save(obj, path)
    res = _cli("consolidate", src, tmp_path / "out")
    assert res.exit_code == 2, res.output
    assert "pp_degree says 3 pipeline stages" in res.output and "mp_rank_00_model_states.pt" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
