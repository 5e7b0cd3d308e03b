"""Real DeepSpeed engines load ckptkit's resharded ZeRO checkpoints at the new world size.

One DeepSpeed launch per target world size (each about a minute here) checks several
resharded fixtures: engine.load_checkpoint succeeds where DeepSpeed alone refuses, the fp32
masters, Adam moments, steps, frozen params, buffers, low-precision weights, lr, counters and
client state it then holds equal the original run's bit for bit (through DeepSpeed's own
safe_get_full_* APIs), and it trains a further step.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from ckptkit.ops.reshard import reshard
from conftest import ROOT, subprocess_env, torchrun_cmd
from helpers.ds_fixtures import DS_DATA, ds_fixtures, needs_deepspeed

FIXTURES = set(ds_fixtures())
# target world size -> fixtures resharded to it: grow and shrink across stages and precisions
PLAN = {
    3: ["z1_fp16_w2", "z3_bf16_w2", "z2_fp32_w2"],
    2: ["z2_bf16_w4", "z3_fp32_w3_subgroups", "z1_fp16_w3"],
    4: ["z3_fp16_w2", "z1_bf16_w2"],
}

pytestmark = [
    pytest.mark.slow,
    needs_deepspeed,
    pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures (run fixtures/generate_deepspeed.py)"),
]


@pytest.mark.parametrize("world", sorted(PLAN))
def test_deepspeed_loads_resharded_checkpoints(tmp_path, world):
    batch = []
    for name in PLAN[world]:
        out = tmp_path / f"{name}_to{world}"
        reshard(str(DS_DATA / name), str(out), world)
        batch.append({"ckpt": str(out), "fixture": name, "truth": str(DS_DATA / f"{name}.truth.pt")})
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(world) + [
        str(ROOT / "tests" / "dist" / "ds_load_check.py"),
        "--batch",
        str(tmp_path / "batch.json"),
        "--result",
        str(result),
    ]
    env = {**subprocess_env(), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(result.read_text())["results"]
    assert [r["fixture"] for r in results] == PLAN[world]
    for r in results:
        assert r["ok"], {k: r.get(k) for k in ("fixture", "error", "mismatches")}
        assert r["world_size"] == world and r["compared"] >= 50 and r["trained_step"]
