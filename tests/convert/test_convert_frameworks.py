"""Backend conversion closed by the other framework: FSDP2 loads what came from DeepSpeed,
DeepSpeed loads what came from FSDP2, each at a world size the source was not saved at, holds
the source's values bit for bit (through its own APIs) and trains a further step.

  ZeRO-3 bf16 @4 -> DCP @2 -> FSDP2 @2         ZeRO-1 fp16 + frozen block @3 -> DCP @3 -> FSDP2 @3
  FSDP2 (tied) @2 -> ZeRO-2 fp32 @3 -> DCP @2 == the start (ckptkit diff exits 0) -> FSDP2 @2

DeepSpeed's engine loads FSDP2 @3 -> ZeRO-3 bf16 @2 and FSDP2 (tied) @2 -> ZeRO-2 fp32 @3 in the
launches of tests/formats/deepspeed/test_ds_engine_matrix.py (layout "from_fsdp2"), from these fixtures.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from click.testing import CliRunner

from ckptkit.ops.convert import convert
from ckptkit_cli.main import cli
from conftest import DATA, ROOT, subprocess_env, torchrun_cmd
from helpers.convert_truth import dm, torch_truth_from_ds
from helpers.ds_fixtures import DS_DATA, ds_fixtures, needs_deepspeed

CV = DATA / "convert"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("z3_bf16_w4" not in ds_fixtures() or not CV.exists(), reason="fixtures missing"),
]


def _fsdp2_load(tmp_path, ckpt, truth: dict, world: int) -> dict:
    truth_file = tmp_path / f"truth_{world}.pt"
    torch.save(truth, truth_file)
    result = tmp_path / f"result_{world}.json"
    cmd = torchrun_cmd(world) + [
        str(ROOT / "tests" / "dist" / "fsdp2_load_check.py"),
        "--model",
        "ds",
        "--ckpt",
        str(ckpt),
        "--truth",
        str(truth_file),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(result.read_text())


def _ds_config(name: str, world: int, tmp_path) -> tuple[dict, str]:
    cfg = dm.with_world_size(json.loads((DS_DATA / name / "ds_config.json").read_text()), world)
    path = tmp_path / f"{name}_w{world}.json"
    path.write_text(json.dumps(cfg))
    return cfg, str(path)


@pytest.mark.parametrize("name,world", [("z3_bf16_w4", 2), ("z1_fp16_w3", 3)])
def test_fsdp2_loads_zero_converted_to_dcp(tmp_path, name, world):
    out = tmp_path / "dcp"
    convert(str(DS_DATA / name), str(out), "dcp", world_size=world)
    ds_truth = torch.load(DS_DATA / f"{name}.truth.pt", weights_only=True)
    cfg = json.loads((DS_DATA / name / "ds_config.json").read_text())
    doc = _fsdp2_load(tmp_path, out, torch_truth_from_ds(ds_truth, cfg), world)
    assert doc["ok"], doc
    assert doc["world_size"] == world and doc["compared"] >= 60 and doc["trained_step"]


@needs_deepspeed
def test_fsdp2_to_zero2_to_dcp_round_trip(tmp_path):
    _, cfg_path = _ds_config("z2_fp32_w2", 3, tmp_path)
    zero = tmp_path / "z2"
    convert(str(CV / "fsdp2ds_w2"), str(zero), "zero2", world_size=3, ds_config=cfg_path)
    start = torch.load(CV / "fsdp2ds_w2.truth.pt", weights_only=True)
    back = tmp_path / "back"
    convert(str(zero), str(back), "dcp", world_size=2)
    same = CliRunner().invoke(cli, ["diff", str(CV / "fsdp2ds_w2"), str(back)])
    assert same.exit_code == 0, same.output
    doc = _fsdp2_load(tmp_path, back, {k: v for k, v in start.items() if k.startswith(("model.", "optim."))}, 2)
    assert doc["ok"], doc
    assert doc["compared"] >= 60 and doc["trained_step"]
