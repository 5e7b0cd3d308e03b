"""DeepSpeed itself loads ckptkit's `convert --to ds-universal` output with
`"checkpoint": {"load_universal": true}` at a data-parallel size the source was not saved at
(2 -> 3 ranks), and every value it restores is bit-equal to what the saving job's
safe_get_full_fp32_param / safe_get_full_optimizer_state returned (tests/dist/ds_universal_load_check.py
says which values a universal load restores); then it trains one more step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import DATA, ROOT, subprocess_env, torchrun_cmd
from helpers.ds_fixtures import needs_deepspeed

pytestmark = [pytest.mark.slow, needs_deepspeed]
DS = DATA / "deepspeed"
TAG = "global_step2_universal"


@pytest.mark.parametrize("name", ["z2_bf16_w2", "z3_fp32_w2"])
def test_deepspeed_loads_converted_universal_checkpoint_at_a_new_dp(tmp_path, name):
    out = tmp_path / "uc"
    conv = subprocess.run(
        [sys.executable, "-m", "ckptkit", "convert", str(DS / name), str(out), "--to", "ds-universal"],
        capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert conv.returncode == 0, conv.stderr[-2000:]
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(3) + [
        str(ROOT / "tests" / "dist" / "ds_universal_load_check.py"),
        *("--ckpt", str(out), "--fixture", name, "--truth", str(DS / f"{name}.truth.pt")),
        *("--result", str(result), "--tag", TAG),
    ]
    proc = subprocess.run(cmd, env={**subprocess_env(), "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["ok"], {k: r.get(k) for k in ("error", "mismatches")}
    assert r["world_size"] == 3 and r["compared"] >= 40 and r["trained_step"]


def test_deepspeed_loads_universal_of_an_autotp_source_at_a_new_dp(tmp_path):
    """An AutoTP checkpoint saved at tp 2 x dp 2, converted to a universal checkpoint, loads on
    2 ranks at tp 2 x dp 1, AutoTP's layers cutting each whole tensor again (at tp 1 x dp 2 too,
    run by hand); every fp32 master, moment and module weight bit-equal to the saving job's truth."""
    tp = 2
    out = tmp_path / "uc"
    conv = subprocess.run(
        [sys.executable, "-m", "ckptkit", "convert", str(DATA / "ds_tp" / "autotp_z1_bf16"), str(out),
         "--to", "ds-universal"],
        capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert conv.returncode == 0, conv.stderr[-2000:]
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(2) + [
        str(ROOT / "tests" / "dist" / "ds_tp_universal_load_check.py"),
        *("--ckpt", str(out), "--fixture", "autotp_z1_bf16", "--tp", str(tp), "--result", str(result)),
    ]
    proc = subprocess.run(cmd, env={**subprocess_env(), "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["ok"], {k: r.get(k) for k in ("error", "mismatches")}
    assert r["world_size"] == 2 and r["tp"] == tp and r["compared"] >= 90
