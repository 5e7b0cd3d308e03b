"""The distributed runner: a command run as a P-process torch.distributed job (`--nproc P` or
torchrun -m ckptkit) writes exactly the bytes the one-process run writes; a failing rank fails
the job with its message and leaves nothing behind; work is dealt out by bytes."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import time

import pytest

from ckptkit.runner.distributed import Group
from conftest import DATA, ROOT, subprocess_env, torchrun_cmd
from helpers.ds_fixtures import DS_DATA, ds_fixtures


def _ckptkit(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _same_tree(a, b) -> None:
    names_a = sorted(str(p.relative_to(a)) for p in a.rglob("*"))
    names_b = sorted(str(p.relative_to(b)) for p in b.rglob("*"))
    assert names_a == names_b
    for name in names_a:
        if (a / name).is_file():
            assert filecmp.cmp(a / name, b / name, shallow=False), name


def test_assign_balances_bytes_and_covers_every_job():
    weights = [100, 1, 50, 50, 30, 20, 0, 7]
    shares = [Group(r, 3).assign(weights) for r in range(3)]
    assert sorted(i for s in shares for i in s) == list(range(len(weights)))
    loads = [sum(weights[i] for i in s) for s in shares]
    assert max(loads) == 100 and min(loads) >= 50  # the 100 alone; the rest split
    assert Group(1, 3).assign(weights) == shares[1]  # the same answer every time
    assert Group(0, 1).assign(weights) == list(range(len(weights)))


CASES = [
    ("reshard", str(DATA / "fsdp2_w2"), ["--to", "3"]),
    ("consolidate", str(DATA / "fsdp2_w3"), ["--max-shard-size", "2KB", "--include-optimizer"]),
    ("convert", str(DATA / "fsdp2_w3"), ["--to", "torch"]),
]
if "z2_bf16_w4" in ds_fixtures():
    CASES += [
        ("reshard", str(DS_DATA / "z2_bf16_w4"), ["--to", "3"]),
        ("convert", str(DS_DATA / "z3_bf16_w4"), ["--to", "dcp", "--world-size", "3"]),
    ]
# model-parallel sources: each writer's files dealt out to the ranks give the same bytes
for _cmd, _src, _args in [
    ("reshard", "ds_tp/mpu_z2_fp32", ["--to", "tp=1,dp=3"]),
    ("reshard", "ds_pp/pp2_dp2_z1_fp32", ["--to", "pp=1,dp=3"]),
    ("consolidate", "ds_tp/autotp_z2_fp32", ["--include-optimizer"]),
    ("convert", "ds_tp/autotp_z1_bf16", ["--to", "fsdp2", "--world-size", "mesh=dp_shard:2,tp:2"]),
]:
    if (DATA / _src).is_dir():
        CASES.append((_cmd, str(DATA / _src), _args))


@pytest.mark.slow
@pytest.mark.parametrize("cmd,src,args", CASES, ids=[f"{c}-{os.path.basename(s)}" for c, s, _ in CASES])
def test_nproc_output_is_identical_to_one_process(tmp_path, cmd, src, args):
    one = _ckptkit(cmd, src, str(tmp_path / "one"), *args)
    assert one.returncode == 0, one.stderr
    many = _ckptkit(cmd, src, str(tmp_path / "many"), *args, "--nproc", "2")
    assert many.returncode == 0, many.stderr
    _same_tree(tmp_path / "one", tmp_path / "many")
    assert many.stdout.count("\n") == one.stdout.count("\n")  # rank 0 reports, the others stay quiet


@pytest.mark.slow
def test_torchrun_module_entry(tmp_path):
    cmd = torchrun_cmd(3) + ["-m", "ckptkit", "reshard", str(DATA / "fsdp2_w3"), str(tmp_path / "t"), "--to", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _ckptkit("reshard", str(DATA / "fsdp2_w3"), str(tmp_path / "o"), "--to", "2").returncode == 0
    _same_tree(tmp_path / "o", tmp_path / "t")


@pytest.mark.slow
def test_a_failing_rank_fails_the_job_with_its_message(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DATA / "dcp_zstd_w2", src)
    with open(src / "__1_0.distcp", "r+b") as f:  # break the zstd frame of an item only some files need
        f.seek(15742)
        f.write(b"XXXX")
    start = time.monotonic()
    res = _ckptkit("reshard", str(src), str(tmp_path / "out"), "--to", "4", "--nproc", "2")
    assert time.monotonic() - start < 120  # no hang waiting for the failed rank
    assert res.returncode == 2, res.stderr
    assert "__1_0.distcp" in res.stderr and "zstd" in res.stderr and "Traceback" not in res.stderr
    assert sum(line.startswith("error:") for line in res.stderr.splitlines()) == 1  # said once, by rank 0
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
