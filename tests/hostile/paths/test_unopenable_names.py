"""Paths that cannot be opened as files: a NUL byte in a file name a DCP checkpoint's metadata gives
is one sentence (verify lists it as a problem), and a --ds-config that is a FIFO, a device or a
folder is refused without blocking, while a regular one still works.

Each case is crafted here as an attacker would, run through the CLI in a subprocess
(tests/helpers/hostile.py) and held to the whole contract.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from pathlib import Path

import pytest

from helpers.hostile import Scene, check_refused, rss_bound, run_ckptkit

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fixtures" / "data"
DCP = DATA / "fsdp2_w2"
DS_CONFIG = DATA / "deepspeed" / "z2_fp32_w2" / "ds_config.json"
BUDGET = 256 << 20
TIMEOUT = 30.0


def _dcp_pointing_at(tmp_path: Path, relative_path: str) -> Path:
    """A copy of a real DCP checkpoint whose .metadata sends rank 0's items to `relative_path`."""
    src = tmp_path / "src"
    shutil.copytree(DCP, src)
    md = pickle.loads((src / ".metadata").read_bytes())
    for key, info in list(md.storage_data.items()):
        if info.relative_path == "__0_0.distcp":
            md.storage_data[key] = dataclasses.replace(info, relative_path=relative_path)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    return src


@pytest.mark.parametrize("cmd", ["inspect", "consolidate"])
def test_dcp_relative_path_with_a_nul_byte_is_one_sentence(tmp_path: Path, cmd: str) -> None:
    # Without this check: os.stat raised "ValueError: embedded null byte", shown as an internal error (exit 3).
    src = _dcp_pointing_at(tmp_path, "__0_0.distcp\0/../../etc/passwd")
    out = tmp_path / "out"
    scene = Scene(src, out)
    args = ["inspect", src] if cmd == "inspect" else [cmd, src, out, "--memory-budget", str(BUDGET)]
    run = run_ckptkit(*args, timeout=TIMEOUT)
    check_refused(run, str(src), scene=scene, rss_limit=rss_bound(BUDGET, (src / ".metadata").stat().st_size))


def test_verify_lists_a_nul_byte_path_as_a_problem(tmp_path: Path) -> None:
    src = _dcp_pointing_at(tmp_path, "a\0b")
    scene = Scene(src)
    run = run_ckptkit("verify", "--deep", src, timeout=TIMEOUT)
    assert run.code == 1, run.detail()
    assert "internal error" not in run.output and "Traceback" not in run.output, run.detail()
    assert "a\\x00b" in run.stdout + run.stderr, run.detail()
    assert scene.source_unchanged()


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_ds_config_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    # Without this check: a FIFO given as --ds-config blocked `convert` forever in open().
    src = tmp_path / "src"
    shutil.copytree(DCP, src)
    config = tmp_path / "ds_config.json"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "device":
        os.symlink("/dev/zero", config)
    else:
        config.mkdir()
    out = tmp_path / "out"
    scene = Scene(src, out)
    run = run_ckptkit("convert", src, out, "--to", "zero2", "--world-size", "2", "--ds-config", config, timeout=TIMEOUT)
    check_refused(run, str(config), scene=scene)


def test_ds_config_that_is_a_regular_file_still_works(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(DCP, src)
    out = tmp_path / "out"
    run = run_ckptkit(
        "convert", src, out, "--to", "deepspeed", "--world-size", "2", "--ds-config", DS_CONFIG, timeout=120
    )
    assert run.code == 0, run.detail()
    assert (out / "latest").is_file()
