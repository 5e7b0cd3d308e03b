"""ckptkit.Checkpointer in real jobs (torchrun, gloo): resume after a crash at another world size,
async saves that keep the values of their step, retention; and a DeepSpeed ZeRO-3 run saved at
4 ranks resumed at 3. The single-process behaviour is in tests/api/test_api.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT, subprocess_env, torchrun_cmd
from helpers.ds_fixtures import DS_DATA, ds_fixtures, needs_deepspeed

pytestmark = pytest.mark.slow
JOB = ROOT / "tests" / "dist" / "checkpointer_job.py"
DS_JOB = ROOT / "tests" / "dist" / "ds_checkpointer_job.py"


def _run(script, world: int, args: list[str], result, env_extra: dict | None = None, timeout: int = 600):
    cmd = torchrun_cmd(world) + [str(script), *args, "--result", str(result)]
    env = {**subprocess_env(), **(env_extra or {})}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_fsdp2_resumes_after_a_kill_at_another_world_size(tmp_path):
    ckpt = tmp_path / "ckpt"
    save = _run(JOB, 3, ["--phase", "save", "--dir", str(ckpt)], tmp_path / "save.json")
    assert save.returncode != 0, "the job was meant to be SIGKILLed"
    assert (tmp_path / "truth_4.pt").exists() and (tmp_path / "truth_6.pt").exists(), save.stderr[-2000:]
    proc = _run(JOB, 2, ["--phase", "resume", "--dir", str(ckpt)], tmp_path / "resume.json")
    assert (tmp_path / "resume.json").exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "resume.json").read_text())
    assert doc["ok"], doc
    assert doc["step"] in (4, 6) and doc["compared"] >= 60 and doc["world_size"] == 2
    assert doc["steps_on_disk"][-1] == doc["step"] and not doc["leftovers"]


def test_async_save_keeps_its_step_and_retention_keeps_exactly_keep(tmp_path):
    proc = _run(JOB, 2, ["--phase", "async", "--dir", str(tmp_path / "ck")], tmp_path / "async.json")
    assert (tmp_path / "async.json").exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "async.json").read_text())
    assert doc["ok"], doc
    assert doc["kept"] == [3, 4]


@needs_deepspeed
@pytest.mark.skipif("z3_bf16_w4" not in ds_fixtures(), reason="no DeepSpeed fixtures")
def test_deepspeed_zero3_saved_at_4_resumes_at_3(tmp_path):
    cfg = str(DS_DATA / "z3_bf16_w4" / "ds_config.json")
    ckpt = tmp_path / "ckpt"
    env = {"DS_ACCELERATOR": "cpu"}
    save = _run(DS_JOB, 4, ["--phase", "save", "--dir", str(ckpt), "--ds-config", cfg], tmp_path / "save.json", env)
    assert (tmp_path / "save.json").exists(), save.stdout[-2000:] + save.stderr[-2000:]
    assert json.loads((tmp_path / "save.json").read_text())["ok"]
    resume = _run(DS_JOB, 3, ["--phase", "resume", "--dir", str(ckpt), "--ds-config", cfg], tmp_path / "r.json", env)
    assert (tmp_path / "r.json").exists(), resume.stdout[-2000:] + resume.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["ok"], doc
    assert doc["step"] == 2 and doc["compared"] >= 50 and doc["extra"] == {"epoch": 3, "note": "hello"}
