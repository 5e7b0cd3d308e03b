"""The inputs of an uneven AutoTP cut, made hostile: a config.json beside the checkpoint that is not
JSON, not an object, huge, or gives a head count that is not a positive number; a rules file whose
"sizes" do not add up; slices of one tensor that differ in more than the split dimension. Each is
refused in one sentence, exit 2, the source untouched and nothing left beside OUT (the contract of
docs/reliability.md, tests/helpers/hostile.py), on the real AutoTP fixture of
fixtures/data/ds_tp_uneven/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers.hostile import Scene, check_refused, run_ckptkit

ROOT = Path(__file__).resolve().parents[3]
ODD = ROOT / "fixtures" / "data" / "ds_tp_uneven" / "autotp_odd_z1_fp32"
TIMEOUT = 60.0
pytestmark = pytest.mark.skipif(not ODD.is_dir(), reason="python fixtures/generate_ds_tp.py --uneven")


def _copy(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ODD, ckpt)
    return ckpt


@pytest.mark.parametrize(
    "config,needles",
    [
        (b"{not json", ("config.json",)),
        (b"[3]", ("config.json is not a JSON object",)),
        (json.dumps({"num_key_value_heads": 0}).encode(), ("num_key_value_heads", "positive integer, not 0")),
        (json.dumps({"num_key_value_heads": "3"}).encode(), ("num_key_value_heads", "positive integer, not '3'")),
        (json.dumps({"text_config": {"num_kv_heads": True}}).encode(), ("num_kv_heads", "not True")),
        (b" " * (17 << 20) + b"{}", ("config.json", "more than the")),
    ],
)
def test_a_hostile_config_json_is_refused(tmp_path: Path, config: bytes, needles: tuple) -> None:
    ckpt = _copy(tmp_path)
    (ckpt / "config.json").write_bytes(config)
    out = tmp_path / "out"
    scene = Scene(ckpt, out)
    run = run_ckptkit("reshard", ckpt, out, "--to", "tp=3,dp=1", timeout=TIMEOUT)
    check_refused(run, *needles, scene=scene)


def test_rules_sizes_that_do_not_add_up_are_refused(tmp_path: Path) -> None:
    ckpt = _copy(tmp_path)
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"pattern": "*.up_proj.weight", "split": 0, "sizes": [12, 12, 12]}]}))
    out = tmp_path / "out"
    scene = Scene(ckpt, out)
    run = run_ckptkit("reshard", ckpt, out, "--to", "tp=3,dp=1", "--tp-rules", rules, timeout=TIMEOUT)
    check_refused(run, "'model.layers.0.mlp.up_proj.weight' into [12, 12, 12]", "of 37", scene=scene)


def test_slices_that_differ_in_another_dimension_are_refused(tmp_path: Path) -> None:
    ckpt = _copy(tmp_path)
    path = ckpt / "global_step2" / "mp_rank_01_model_states.pt"
    saved = torch.load(path, weights_only=False)  # trusted: the project's own fixture
    name = "model.layers.0.mlp.gate_proj.weight"
    saved["module"][name] = saved["module"][name][:, :-1].clone()
    torch.save(saved, path)
    scene = Scene(ckpt, None)
    run = run_ckptkit("inspect", ckpt, timeout=TIMEOUT)
    check_refused(run, "gate_proj", "differ in shape", scene=scene)
