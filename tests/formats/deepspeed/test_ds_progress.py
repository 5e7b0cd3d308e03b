"""The progress count of a DeepSpeed write ends at exactly its total.

The operation starts its progress with the source's tensor bytes; a DeepSpeed writer then writes
something else (each rank's flat partitions with their padding, tensors repeated on every tp or
dp rank, copied layer and expert files), so at dp=64 a count of the source bytes would pass 100%. write_tag
(formats/deepspeed/tag_writer.py) corrects the total to what it will write (progress.retotal):
the bytes declared must equal the bytes advanced.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from ckptkit.context import RunContext
from ckptkit.ops.reshard import reshard
from conftest import DATA, ROOT, subprocess_env


class Counting:
    """A Progress that keeps the declared total (as retotal corrects it) and the bytes advanced."""

    def __init__(self) -> None:
        self.total, self.done, self.phase, self.retotals = 0, 0, 0, 0
        self._lock = threading.Lock()

    def start(self, total: int, desc: str) -> None:
        self.total += total
        self.phase = total

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n

    def retotal(self, total: int) -> None:
        self.total += total - self.phase
        self.phase = total
        self.retotals += 1

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "name,to",
    [
        ("ds_tp/mpu_z2_bf16", "tp=2,dp=64"),
        ("ds_tp/autotp_z3_bf16", "tp=1,dp=8"),
        ("ds_moe/moe_z1_bf16_w4_k2", "ep=2,dp=64"),
        ("ds_pp/pp2_dp2_z1_fp32", "pp=2,dp=16"),
        ("deepspeed/z1_bf16_w2", "16"),  # a tensor twice in one file is stored (and counted) once
        ("deepspeed/z3_fp32_w3_subgroups", "5"),
    ],
)
def test_reshard_progress_ends_at_its_total(tmp_path, name, to):
    if not (DATA / name).is_dir():
        pytest.skip(f"no fixture {name}")
    p = Counting()
    res = reshard(str(DATA / name), str(tmp_path / "out"), to, ctx=RunContext(progress=p))
    assert p.retotals == 1 and p.done == p.total, (p.done, p.total)
    written = sum(f.stat().st_size for f in (tmp_path / "out").rglob("*") if f.is_file())
    assert res.bytes < p.total < written  # more than the source's tensors, less than the files (headers)


def test_the_progress_line_ends_at_100_percent(tmp_path):
    src = DATA / "ds_tp" / "mpu_z2_bf16"
    if not src.is_dir():
        pytest.skip("no fixture ds_tp/mpu_z2_bf16")
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", "reshard", str(src), str(tmp_path / "out"), "--to", "tp=2,dp=64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**subprocess_env(), "CKPTKIT_PROGRESS_INTERVAL": "0"},
    )
    assert proc.returncode == 0, proc.stderr
    percents = [line for line in proc.stderr.splitlines() if line.startswith("reshard ") and "%)" in line]
    assert percents and percents[-1].split("(")[1].startswith("100%)"), percents[-3:]
    assert all(int(line.split("(")[1].split("%")[0]) <= 100 for line in percents), percents
