"""SIGKILL at many points of consolidate, reshard and convert never leaves an OUT that looks complete;
a rerun succeeds (the dead run's lock is recognised as stale) and the source is untouched."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from ckptkit.ops.verify import verify
from conftest import save_random_dcp, subprocess_env

# when to kill, as fractions of an uninterrupted run of the same command on this machine:
# start-up, indexing, reading, mid-write, commit
KILL_AT = [0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95]


def _digest(path) -> str:
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("crash") / "src"
    save_random_dcp(path, 12, (2048, 1024), seed=0, name="layer{i}.weight")  # 96 MB
    return path


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op", ["consolidate", "reshard", "convert"])
def test_sigkill_never_leaves_a_complete_looking_output(tmp_path, source, op):
    before = _digest(source)
    extra = {"reshard": ["--to", "3"], "convert": ["--to", "torch"]}.get(op, [])

    def start(out):
        return subprocess.Popen(
            [sys.executable, "-m", "ckptkit", "--quiet", op, str(source), str(out), *extra, "--memory-budget", "16MB"],
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    t0 = time.perf_counter()
    assert start(tmp_path / "timed").wait() == 0
    duration = time.perf_counter() - t0
    outcomes = []
    for i, fraction in enumerate(KILL_AT):
        out = tmp_path / f"out{i}"
        args = [str(source), str(out), *extra]
        proc = start(out)
        time.sleep(fraction * duration)
        finished = proc.poll() is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():
            _, problems = verify(str(out), deep=True)
            assert not problems, (fraction, problems)  # whatever exists at OUT is complete
            outcomes.append("complete")
        else:
            outcomes.append("absent")
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".out{i}.")]
        assert all(".ckptkit-" in n for n in leftovers)  # only hidden temp/lock siblings, never OUT
        # a rerun into the same OUT succeeds: the dead run's lock is stale, its temp folder ignored
        rerun = subprocess.run(
            [sys.executable, "-m", "ckptkit", "--quiet", op, *args, "--overwrite"],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        _, problems = verify(str(out), deep=True)
        assert not problems
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".out{i}.")]  # dead run cleaned up
        if finished:
            break
    assert "absent" in outcomes, (duration, outcomes)  # at least one kill landed mid-run
    assert _digest(source) == before  # the source is never modified
