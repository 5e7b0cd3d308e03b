"""convert --to ds-universal writes what DeepSpeed's own ds_to_universal writes: from real ZeRO
fixtures, every zero/<param>/<state>.pt holds the same tensor (and step) as ds_to_universal's
output of the same checkpoint (fixtures/data/ds_universal/, loaded by torch.load), and the
folder reads back as DeepSpeed's truth; from FSDP2's DCP, it reads back as torch's truth."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import DATA, ROOT, assert_tensor_equal, read_all

DS = DATA / "deepspeed"
UC = DATA / "ds_universal"
TAG = "global_step2_universal"


def convert(src, out) -> None:
    cmd = [sys.executable, "-m", "ckptkit", "convert", str(src), str(out), "--to", "ds-universal"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("name", ["z2_bf16_w2", "z3_fp32_w2"])
def test_each_state_file_equals_what_ds_to_universal_wrote(tmp_path, name):
    out = tmp_path / "uc"
    convert(DS / name, out)
    assert (out / "latest_universal").read_text() == TAG
    theirs = UC / name / TAG / "zero"
    ours = out / TAG / "zero"
    compared = 0
    for param in sorted(p.name for p in theirs.iterdir() if p.is_dir()):
        if not (theirs / param / "exp_avg.pt").exists():
            continue  # ds_to_universal also copies frozen parameters' and buffers' module values
        for state in sorted(f.name for f in (theirs / param).iterdir()):
            want = torch.load(theirs / param / state, weights_only=True)  # trusted: DeepSpeed's own output
            got = torch.load(ours / param / state, weights_only=True)
            if state == "step.pt":
                assert got == want, f"{param}/{state}"
            else:
                want = want["param"] if isinstance(want, dict) else want
                assert_tensor_equal(got["param"].flatten(), want.flatten(), f"{param}/{state}")
                assert tuple(got["param"].shape) == tuple(read_shape(out, param))
            compared += 1
    assert compared >= 27


def read_shape(out, param):
    opened, tensors, _ = read_all(out)
    return tensors[f"model.{param}"].shape


@pytest.mark.parametrize("name", ["z1_fp16_w2", "z2_bf16_w4", "z3_bf16_w2"])
def test_zero_source_converted_reads_as_deepspeed_truth(tmp_path, name):
    out = tmp_path / "uc"
    convert(DS / name, out)
    _, tensors, objects = read_all(out)
    truth = torch.load(DS / f"{name}.truth.pt", weights_only=True)
    checked = 0
    for key, value in truth.items():
        kind, _, param = key.partition(".")
        target = {"fp32": "model.{}", "exp_avg": "optim.state.{}.exp_avg", "exp_avg_sq": "optim.state.{}.exp_avg_sq"}
        if kind in target:
            assert_tensor_equal(tensors[target[kind].format(param)], value, key)
            checked += 1
        elif kind == "step":
            assert int(objects[f"optim.state.{param}.step"]) == int(value), key
        elif kind == "client":
            assert objects[f"client.{param}"] == value, key
        elif key == "global_steps":
            assert objects["ds.global_steps"] == value
    assert checked >= 27


def test_fsdp2_source_converted_reads_as_torch_truth(tmp_path):
    out = tmp_path / "uc"
    convert(DATA / "fsdp2_w2", out)
    _, tensors, objects = read_all(out)
    truth = torch.load(DATA / "fsdp2_w2.truth.pt", weights_only=True)
    trainable = [k[len("optim.state.") : -len(".exp_avg")] for k in truth if k.endswith(".exp_avg")]
    assert trainable
    for name in trainable:
        assert_tensor_equal(tensors[f"model.{name}"], truth[f"model.{name}"].float(), name)
        for state in ("exp_avg", "exp_avg_sq"):
            key = f"optim.state.{name}.{state}"
            assert_tensor_equal(tensors[key], truth[key], key)
        step = objects.get(f"optim.state.{name}.step")
        assert float(step) == float(truth[f"optim.state.{name}.step"]), name


def test_a_source_without_optimizer_state_is_refused(tmp_path):
    from helpers.hostile import Scene, check_refused, run_ckptkit

    src, out = DATA / "plain_state_dict.pt", tmp_path / "uc"
    run = run_ckptkit("convert", src, out, "--to", "ds-universal")
    check_refused(run, str(src), "has no optimizer state", scene=Scene(src, out))
