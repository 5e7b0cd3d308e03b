"""ZeRO reshard: every fixture rewritten for other world sizes reads back equal to DeepSpeed's
truth, carries DeepSpeed's bookkeeping for the new size, and DeepSpeed's own zero_to_fp32 reads
it. Real DeepSpeed engines loading the output are in test_ds_engine_matrix.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ckptkit.ops.reshard import reshard
from conftest import assert_tensor_equal, read_all, subprocess_env
from helpers.ds_fixtures import DS_DATA, ds_fixtures, fixture_info, needs_deepspeed, truth_key

FIXTURES = ds_fixtures()
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures (run fixtures/generate_deepspeed.py)")
CASES = [(n, m) for n in FIXTURES for m in (1, 2, 3, 4, 5) if m != fixture_info(n)["world_size"]]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("zero_reshard")
    done = {}
    for name, m in CASES:
        out = base / f"{name}_to{m}"
        reshard(str(DS_DATA / name), str(out), m)
        done[(name, m)] = out
    return done


@pytest.mark.parametrize("name,m", CASES, ids=[f"{n}->{m}" for n, m in CASES])
def test_resharded_reads_back_equal_to_truth(outputs, name, m):
    info = fixture_info(name)
    opened, tensors, objects = read_all(outputs[(name, m)])
    index = opened.index
    assert index.world_size == m and index.metadata["deepspeed"]["stage"] == info["stage"]
    truth = torch.load(DS_DATA / f"{name}.truth.pt", weights_only=True)
    for key, expected in truth.items():
        kind, _, pname = key.partition(".")
        if kind == "module" and info["stage"] == 3:
            continue
        ours = truth_key(kind, pname)
        if ours is not None and isinstance(expected, torch.Tensor):
            assert_tensor_equal(tensors[ours], expected, key)
    assert objects["ds.dp_world_size"] == m
    assert objects["ds.global_steps"] == truth["global_steps"]
    assert objects["client.note"] == "hello"
    tag = outputs[(name, m)] / "global_step2"
    prefix = "bf16_" if info["dtype"] == "bf16" else ""
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == sorted(
        f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(m)
    )
    assert (outputs[(name, m)] / "latest").read_text() == "global_step2"


@pytest.mark.parametrize("name,m", [c for c in CASES if fixture_info(c[0])["stage"] < 3][:6])
def test_stage12_bookkeeping_matches_deepspeed_rules(outputs, name, m):
    """partition_count, group_paddings and param_slice_mappings are what DeepSpeed computes at M."""
    from ckptkit.formats.registry import open_checkpoint

    native = open_checkpoint(str(outputs[(name, m)])).index.native.cell()
    for rank in range(m):
        osd = native.optim_states[rank]["optimizer_state_dict"]
        assert osd["partition_count"] == [m] * len(native.groups)
        for g, grp in enumerate(native.groups):
            numel = sum(torch.Size(s).numel() for _, s in grp.params)
            ps = -(-numel // (2 * m)) * 2 * m // m
            start = rank * ps
            assert osd["group_paddings"][g] == (ps if numel <= start else max(0, start + ps - numel))
            mapped = sum(f.numel for f in osd["param_slice_mappings"][g].values())
            assert mapped == max(0, min(ps, numel - start))


ZERO_TO_FP32 = r"""
import json, sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
out = {}
for name, path in json.loads(sys.argv[1]).items():
    sd = get_fp32_state_dict_from_zero_checkpoint(path)
    out[name] = {k: v.contiguous().clone() for k, v in sd.items()}
torch.save(out, sys.argv[2])
"""


@needs_deepspeed
def test_zero_to_fp32_reads_resharded_output(outputs, tmp_path):
    chosen = {f"{n}->{m}": str(outputs[(n, m)]) for n, m in CASES if m in (3, 4)}
    env = {**subprocess_env(), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", ZERO_TO_FP32, json.dumps(chosen), str(tmp_path / "z.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(tmp_path / "z.pt", weights_only=True)
    for case, sd in results.items():
        name = case.split("->")[0]
        truth = torch.load(DS_DATA / f"{name}.truth.pt", weights_only=True)
        for key, expected in truth.items():
            kind, _, pname = key.partition(".")
            if kind == "fp32":
                assert_tensor_equal(sd[pname], expected, f"{case}:{pname}")
