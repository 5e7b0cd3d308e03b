"""DeepSpeed pipeline-parallel checkpoints (PipelineModule, ZeRO 1) against real DeepSpeed runs.

The fixtures (fixtures/generate_ds_pp.py) were written by DeepSpeed on CPU at pp=2 x dp=2 (fp32,
bf16) and pp=2 x dp=1; the truth was taken on every rank through DeepSpeed's API
(safe_get_full_fp32_param, safe_get_full_optimizer_state, the stage module's parameters and
buffers) and gathered. Names are PipelineModule's: `<layer>.<param>`, `tied_modules.embed.weight`.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.ops.consolidate import consolidate
from conftest import DATA, assert_tensor_equal, read_all
from helpers.corrupt import run_cli

PP_DATA = DATA / "ds_pp"
ALL = sorted(p.name for p in PP_DATA.iterdir() if p.is_dir()) if PP_DATA.exists() else []
# ZeRO stage 1, and stage 0 with bf16 (DeepSpeed's BF16_Optimizer); stage 0 in fp32 is refused
REFUSED = [
    n for n in ALL if json.loads((PP_DATA / n / "fixture.json").read_text())["zero_optimizer"].endswith(".FusedAdam")
]
FIXTURES = [n for n in ALL if n not in REFUSED]
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no pipeline fixtures (run fixtures/generate_ds_pp.py)")
INDEX_KEY = {
    "fp32": "model.{}",
    "exp_avg": "optim.state.{}.exp_avg",
    "exp_avg_sq": "optim.state.{}.exp_avg_sq",
    "frozen": "model.{}",
    "buffer": "model.{}",
    "module": "ds_module.{}",
}


def _truth(name: str) -> dict:
    return torch.load(PP_DATA / f"{name}.truth.pt", weights_only=True)


def _info(name: str) -> dict:
    return json.loads((PP_DATA / name / "fixture.json").read_text())


@pytest.mark.parametrize("name", FIXTURES)
def test_index_equals_deepspeed_truth(name):
    info, truth = _info(name), _truth(name)
    opened, tensors, objects = read_all(PP_DATA / name)
    index = opened.index
    assert index.format == "deepspeed" and index.world_size == info["pp"] * info["dp"]
    assert index.metadata["parallel"] == {"pp": info["pp"], "dp": info["dp"]}
    compared = 0
    for key, expected in truth.items():
        kind, _, pname = key.partition(".")
        if kind in INDEX_KEY:
            assert_tensor_equal(tensors[INDEX_KEY[kind].format(pname)], expected, key)
            compared += 1
        elif kind == "step":
            assert objects[f"optim.state.{pname}.step"] == expected, key
        elif kind == "stage":  # every entry of a parameter names the stage holding it
            for pattern in ("model.{}", "ds_module.{}"):
                assert tensors and index.tensors[pattern.format(pname)].attrs["parallel"] == {
                    "pp": {"stage": expected, "size": info["pp"]}
                }, key
    assert (
        compared == sum(1 for k in truth if k.partition(".")[0] in INDEX_KEY) == 56
    )  # 13 trainable x 4, the frozen one x 2, 2 buffers
    # nothing beyond what DeepSpeed has: the tied embedding once, every parameter and buffer
    names = {k.partition(".")[2] for k in truth if k.startswith(("module.", "buffer."))}
    assert {k[len("model.") :] for k in index.tensors if k.startswith("model.")} == names
    assert objects["ds.global_steps"] == truth["global_steps"] == index.step == 2
    assert objects["client.epoch"] == 3
    assert {objects["optim.param_groups.0.lr"]} == {truth[f"lr.{s}.0"] for s in range(info["pp"])}
    params = objects["optim.param_groups.0.params"]
    assert params.count("tied_modules.embed.weight") == 1 and "4.weight" in params and "1.fc_in.weight" in params
    # each layer file with its stage, as PipelineModule partitioned them (the tied head, layer 5,
    # has a file only when it is the module itself: variant "tiedhead")
    parts, tag = info["parts"], PP_DATA / name / "global_step2"
    assert index.metadata["deepspeed"]["pipeline"]["layers"] == {
        str(layer): s
        for s in range(info["pp"])
        for layer in range(parts[s], parts[s + 1])
        if any(tag.glob(f"layer_{layer:02d}-*model_states.pt"))
    }
    assert any(tag.glob("layer_05-*model_states.pt")) == (info.get("variant") == "tiedhead")


@pytest.mark.parametrize("name", FIXTURES)
def test_consolidate_is_bit_exact(tmp_path, name):
    truth = _truth(name)
    res = consolidate(str(PP_DATA / name), str(tmp_path / "out"), include_optimizer=True)
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    optim = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    expected_model = {}
    for key, value in truth.items():
        kind, _, pname = key.partition(".")
        if kind in ("fp32", "frozen", "buffer"):  # masters as they are, the rest upcast (zero_to_fp32's way)
            expected_model[pname] = value.float() if value.is_floating_point() else value
        elif kind in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(optim[f"state.{pname}.{kind}"], value, key)
    assert sorted(out) == sorted(expected_model)
    for pname, value in expected_model.items():
        assert_tensor_equal(out[pname], value, pname)
    assert not res.aliases


def test_convert_to_torch_and_dcp_keep_the_pipeline_names(tmp_path):
    name = "pp2_dp2_z1_bf16"
    truth = _truth(name)
    assert run_cli("convert", PP_DATA / name, tmp_path / "t.pt", "--to", "torch").code == 0
    saved = torch.load(tmp_path / "t.pt", weights_only=True)
    for key, value in truth.items():
        kind, _, pname = key.partition(".")
        if kind == "fp32":
            assert_tensor_equal(saved["model"][pname], value, key)
        elif kind == "exp_avg":
            assert_tensor_equal(saved["optim"]["state"][pname]["exp_avg"], value, key)
    assert run_cli("convert", PP_DATA / name, tmp_path / "dcp", "--to", "fsdp2", "--world-size", "2").code == 0
    back, tensors, _ = read_all(tmp_path / "dcp")
    assert back.index.format == "dcp"
    for key, value in truth.items():
        kind, _, pname = key.partition(".")
        if kind == "fp32":
            assert_tensor_equal(tensors[f"model.{pname}"], value, key)


def test_verify_diff_and_plan_read_it(tmp_path):
    a = PP_DATA / "pp2_dp2_z1_fp32"
    res = run_cli("verify", a)
    assert res.code == 0 and "structure sound" in res.output, res.output
    assert run_cli("convert", a, tmp_path / "t.pt", "--to", "torch").code == 0
    res = run_cli("diff", a, tmp_path / "t.pt")  # its own conversion: every value the same
    assert res.code == 0 and "compared 65 equal" in res.output and "different" not in res.output, res.output
    res = run_cli("diff", a, PP_DATA / "pp2_dp1_z1_fp32")  # dp 2 vs 1: gradients averaged, rounded apart
    assert res.code == 1 and "different optimizer:state.2.proj.weight.exp_avg" in res.output, res.output
    res = run_cli("plan", a)
    assert res.code == 0 and "layer_02-model_states.pt" in res.output, res.output


def test_convert_to_zero_is_refused_pointing_to_reshard(tmp_path):
    """reshard --to pp=...,dp=... writes pipelines (test_ds_pp_reshard.py); convert --to zero* does not."""
    src, out = PP_DATA / "pp2_dp2_z1_fp32", tmp_path / "out"
    res = run_cli("convert", src, out, "--to", "zero1", "--world-size", "2")
    assert res.code == 2, res.output
    assert (
        "converting a DeepSpeed pipeline-parallel checkpoint to ZeRO is not supported yet; reshard it with "
        "--to pp=...,dp=..."
        in res.output
        and "Traceback" not in res.output
    )
    assert not out.exists()


def _copy(tmp_path, name="pp2_dp2_z1_fp32"):
    dest = tmp_path / name
    shutil.copytree(PP_DATA / name, dest)
    return dest, dest / "global_step2"


def _wrong_shape(tag):
    """layer 1's fc_in.weight saved with one row too many (a hostile file, made with torch.save)."""
    path = tag / "layer_01-model_states.pt"
    state = torch.load(path, weights_only=True)
    state["fc_in.weight"] = torch.zeros(7, 8)
    torch.save(state, path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_layer", r"layer_03-model_states.pt: file is missing \(pipeline stage 1 holds layer 3's"),
        (
            "missing_stage_optim_rank",
            r"says dp_world_size 2, but the optim-states file of rank 1 is missing "
            r"\(zero_pp_rank_1_mp_rank_01_optim_states.pt\)",
        ),
        ("missing_stage_optim", r"no \*_optim_states.pt files of model-parallel rank 1"),
        (
            "missing_stage",
            r"mp_rank_00_model_states.pt: says the pipeline has 2 stages, but the model- and optim-states "
            r"files of stage\(s\) \[1\] \(mp_rank_01_...\) are missing",
        ),
        (
            "wrong_shape",
            r"layer_01-model_states.pt: fc_in.weight has shape \[7, 8\], but pipeline stage 0's "
            r"param_shapes says 1.fc_in.weight is \[6, 8\]",
        ),
        # Megatron-DeepSpeed's topology names layer files `-model_00`
        (
            "mptopo_missing_layer",
            r"layer_04-model_00-model_states.pt: file is missing \(pipeline stage 1 holds layer 4's",
        ),
        # a `-model_01` file says tp 2: every layer then needs one (test_ds_3d.py reads real ones)
        (
            "mptopo_tp_layer_file",
            r"layer_00-model_01-model_states.pt: file is missing \(tensor-parallel rank 0 has layer "
            r"0's file; a pipeline with 2 tensor-parallel ranks writes one per rank\)",
        ),
    ],
)
def test_broken_pipeline_checkpoints_are_named(tmp_path, case, message):
    import re

    d, tag = _copy(tmp_path, "pp2_dp2_z1_fp32_mptopo" if case.startswith("mptopo") else "pp2_dp2_z1_fp32")
    if case == "mptopo_missing_layer":
        (tag / "layer_04-model_00-model_states.pt").unlink()
    elif case == "mptopo_tp_layer_file":
        shutil.copy(tag / "layer_01-model_00-model_states.pt", tag / "layer_01-model_01-model_states.pt")
    elif case == "missing_layer":
        (tag / "layer_03-model_states.pt").unlink()
    elif case == "missing_stage_optim_rank":
        (tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    elif case == "missing_stage_optim":
        for f in tag.glob("zero_pp_rank_*_mp_rank_01_optim_states.pt"):
            f.unlink()
    elif case == "missing_stage":
        for f in tag.glob("*mp_rank_01_*.pt"):
            f.unlink()
    elif case == "wrong_shape":
        _wrong_shape(tag)
    for command in (("consolidate", d, tmp_path / "out"), ("inspect", d)):
        res = run_cli(*command)
        assert res.code == 2, (case, command[0], res.output)
        lines = [
            line
            for line in res.output.splitlines()
            if line.strip() and "UserWarning" not in line and "parse_args" not in line and "make_parser" not in line
        ]
        assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), res.output


@pytest.mark.parametrize("name", REFUSED)
def test_zero0_fp32_pipeline_is_refused(name):
    """ZeRO 0 in fp32: DeepSpeed keeps the torch optimizer's state in the model-states files."""
    res = run_cli("inspect", PP_DATA / name)
    assert (
        res.code == 2
        and "a pipeline checkpoint without ZeRO optim-states files" in res.output
        and "Traceback" not in res.output
    )


def test_bf16_optimizer_is_read_as_its_flat_partitions():
    """BF16_Optimizer saves no param_shapes: names and shapes come from param_slice_mappings and
    the layer files, and the index says which optimizer wrote it."""
    opened, _, objects = read_all(PP_DATA / "pp2_dp2_z0_bf16")
    meta = opened.index.metadata["deepspeed"]
    assert meta["optimizer"] == "BF16_Optimizer" and meta["stage"] == 0 and meta["dtype"] == "bfloat16"
    assert objects["ds.zero_stage"] == 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed package")
def test_consolidated_weights_load_strictly_into_pipeline_module_and_train(tmp_path):
    """The names are PipelineModule's own: its full (one-stage) module loads them strictly,
    holds DeepSpeed's truth bit for bit, and DeepSpeed trains a step from it (~20 s)."""
    import subprocess
    import sys

    from conftest import ROOT, subprocess_env

    name = "pp2_dp2_z1_fp32"
    consolidate(str(PP_DATA / name), str(tmp_path / "out"))
    result = tmp_path / "result.json"
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "dist" / "ds_pp_load_check.py"),
        "--weights",
        str(tmp_path / "out" / "model.safetensors"),
        "--truth",
        str(PP_DATA / f"{name}.truth.pt"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(
        cmd, env={**subprocess_env(), "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=300
    )
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["compared"] == 16 and not r["mismatches"] and not r["missing"] and not r["unexpected"], r
    assert "tied_modules.embed.weight" in r["keys"] and "2.frozen.weight" in r["keys"]
    assert 0 < r["loss"] < 10


def test_verify_deep_compares_the_tied_copies_of_later_stages(tmp_path):
    """The tied module's copy on stage 1 (here its own layer file, layer 5) is not in the index
    but verify --deep compares it with stage 0's; a changed element is named."""
    d, tag = _copy(tmp_path, "pp2_dp1_z1_fp32_tiedhead")
    res = run_cli("verify", "--deep", d)
    assert res.code == 0 and "every byte read" in res.output, res.output
    path = tag / "layer_05-model_states.pt"
    state = torch.load(path, weights_only=True)
    state["weight"][3, 2] += 1
    torch.save(state, path)
    res = run_cli("verify", "--deep", d)
    assert res.code == 1, res.output
    assert "tensor ds_module.tied_modules.embed.weight: pipeline stage 1's copy" in res.output
    assert "layer_05-model_states.pt) differs from the copy read" in res.output, res.output
