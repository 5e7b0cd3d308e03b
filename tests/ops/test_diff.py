"""ckptkit diff: any two checkpoints, any formats, after key normalisation."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckptkit.ops.consolidate import consolidate
from ckptkit.ops.diff import diff, normalize
from ckptkit.ops.reshard import reshard
from ckptkit_cli.main import cli
from conftest import DATA, load_truth
from helpers.ds_fixtures import DS_DATA, ds_fixtures


def test_normalize_drops_wrapper_prefixes():
    assert normalize("module._orig_mod.layers.0.weight") == "layers.0.weight"
    assert normalize("layers.0._fsdp_wrapped_module.attn.weight") == "layers.0.attn.weight"
    assert normalize("model.embed.weight") == "embed.weight"


def test_same_state_in_other_formats_and_layouts_is_equal(tmp_path):
    reshard(str(DATA / "fsdp2_w2"), str(tmp_path / "w3"), 3)
    assert diff(str(DATA / "fsdp2_w2"), str(tmp_path / "w3")).equal  # model and optimizer
    consolidate(str(DATA / "fsdp2_w2"), str(tmp_path / "st"))
    result = diff(str(DATA / "fsdp2_w2"), str(tmp_path / "st"), model_only=True)
    assert result.equal and result.counts() == {"equal": 13}


@pytest.mark.skipif("z2_bf16_w4" not in ds_fixtures(), reason="no DeepSpeed fixtures")
def test_zero_reshard_is_equal_to_its_source(tmp_path):
    reshard(str(DS_DATA / "z2_bf16_w4"), str(tmp_path / "r"), 3)
    result = diff(str(DS_DATA / "z2_bf16_w4"), str(tmp_path / "r"))
    assert result.equal and result.counts()["equal"] >= 30


def test_differences_are_measured_and_tolerance_applies():
    result = diff(str(DATA / "fsdp2_w2"), str(DATA / "fsdp2_w3"))  # 2 vs 3 ranks: last-bit gradient sums
    assert not result.equal
    worst = max(r.max_abs_diff for r in result.rows if r.status == "different")
    assert 0 < worst < 1e-6
    assert diff(str(DATA / "fsdp2_w2"), str(DATA / "fsdp2_w3"), atol=1e-6).equal


def test_missing_dtype_and_shape_are_reported(tmp_path):
    truth = load_truth("fsdp2_w2")
    model = {k[len("model.") :]: v for k, v in truth.items() if k.startswith("model.")}
    changed = dict(model)
    del changed["gate"]
    changed["extra"] = torch.zeros(2)
    changed["pos"] = model["pos"].to(torch.bfloat16)
    changed["block.fc_in.bias"] = torch.zeros(8)
    changed["norm.bias"] = model["norm.bias"].clone()
    changed["norm.bias"][3] += 0.5
    changed["lm_head.weight"] = changed["lm_head.weight"].clone()
    save_file(changed, str(tmp_path / "b.safetensors"))
    rows = {r.name: r for r in diff(str(DATA / "fsdp2_w2"), str(tmp_path / "b.safetensors"), model_only=True).rows}
    assert rows["gate"].status == "missing_b" and rows["extra"].status == "missing_a"
    assert rows["pos"].status == "dtype" and rows["block.fc_in.bias"].status == "shape"
    assert rows["norm.bias"].status == "different" and rows["norm.bias"].max_abs_diff == pytest.approx(0.5)
    assert rows["embed.weight"].status == "equal"


def test_nan_in_the_same_place_is_equal(tmp_path):
    t = torch.tensor([1.0, float("nan"), 3.0])
    save_file({"w": t}, str(tmp_path / "a.safetensors"))
    save_file({"w": t.clone()}, str(tmp_path / "b.safetensors"))
    assert diff(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")).equal
    u = t.clone()
    u[1] = 2.0
    save_file({"w": u}, str(tmp_path / "c.safetensors"))
    assert not diff(str(tmp_path / "a.safetensors"), str(tmp_path / "c.safetensors"), atol=10).equal


def test_cli_exit_codes_and_json(tmp_path):
    runner = CliRunner()
    same = runner.invoke(cli, ["diff", str(DATA / "fsdp2_w2"), str(DATA / "fsdp2_w2")])
    verdicts = [line for line in same.output.splitlines() if not line.startswith("done in")]  # + the closing line
    assert same.exit_code == 0 and verdicts[-1] == "equal"
    other = runner.invoke(cli, ["diff", "--json", "--model-only", str(DATA / "fsdp2_w2"), str(DATA / "fsdp2_w3")])
    assert other.exit_code == 1
    doc = json.loads(other.output)
    assert doc["equal"] is False and doc["counts"]["different"] >= 1
    assert {"name", "status", "max_abs_diff", "detail"} <= set(doc["rows"][0])
    bad = runner.invoke(cli, ["diff", str(DATA / "fsdp2_w2"), str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
