"""DCP reshard: the output equals the truth, is laid out one file per rank, and a real FSDP2 job
at the new world size loads it with dcp.load and holds exactly the original state."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from ckptkit.index import geometry
from ckptkit.index.layouts import chunk_dim0
from ckptkit.ops.reshard import reshard
from conftest import DATA, ROOT, assert_tensor_equal, load_truth, read_all, subprocess_env, torchrun_cmd

CASES = [("fsdp2_w2", 3), ("fsdp2_w3", 2), ("fsdp2_w2", 1), ("fsdp2_w3", 4), ("fsdp1_sharded_w2", 3)]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    out = {}
    base = tmp_path_factory.mktemp("reshard")
    for name, m in CASES:
        target = base / f"{name}_to{m}"
        res = reshard(str(DATA / name), str(target), m)
        assert res.to_world_size == m
        out[(name, m)] = target
    return out


@pytest.mark.parametrize("name,m", CASES)
def test_reshard_output_equals_truth(resharded, name, m):
    truth = load_truth(name)
    opened, tensors, objects = read_all(resharded[(name, m)])
    assert opened.index.world_size == m
    assert sorted(n for n in opened.index.files if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(m)]
    for key, expected in truth.items():
        if isinstance(expected, torch.Tensor):
            assert_tensor_equal(tensors[key], expected, key)
        else:
            assert objects[key] == expected, key


@pytest.mark.parametrize("name,m", CASES)
def test_each_rank_file_holds_only_its_fsdp2_shard(resharded, name, m):
    opened, _, _ = read_all(resharded[(name, m)])
    for key, entry in opened.index.tensors.items():
        if len(entry.pieces) == 1 and entry.pieces[0].location.file == "__0_0.distcp":
            continue  # replicated, written once
        boxes = chunk_dim0(entry.shape, m)
        for piece in entry.pieces:
            rank = int(piece.location.file.split("_")[2])
            assert geometry.contains(boxes[rank], piece.region) or piece.region.numel == 0, (key, rank)


def test_reshard_from_mismatch_is_an_error(tmp_path):
    from ckptkit.errors import UsageError

    with pytest.raises(UsageError, match="world size 2, not 3"):
        reshard(str(DATA / "fsdp2_w2"), str(tmp_path / "out"), 4, expect_from=3)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name,m", CASES)
def test_fsdp2_job_loads_resharded_checkpoint(resharded, tmp_path, name, m):
    """A real FSDP2 job at M ranks dcp.loads the output; full state equals the truth bit for bit."""
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(m) + [
        str(ROOT / "tests" / "dist" / "fsdp2_load_check.py"),
        "--ckpt",
        str(resharded[(name, m)]),
        "--truth",
        str(DATA / f"{name}.truth.pt"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result.read_text())
    assert doc["ok"], doc
    assert doc["world_size"] == m
    assert doc["compared"] >= 60 and not doc["mismatches"]
    assert doc["trained_step"]
