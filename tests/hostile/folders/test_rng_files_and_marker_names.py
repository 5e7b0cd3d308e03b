"""Hostile Trainer folders and Checkpointer markers in the spellings test_hostile_folders.py does
not cover: accelerate's RNG files, a name with a trailing line break, a marker path no file system
can name; and verify never calls "ok" a folder that reshard refuses.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ckptkit
from helpers.hostile import run_ckptkit

ROOT = Path(__file__).resolve().parents[3]
TRAINER = ROOT / "fixtures" / "data" / "trainer"
MARKER = ".ckptkit-complete"


def _copy(tmp_path: Path, kind: str) -> Path:
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(TRAINER / kind / "checkpoint-2", folder)
    return folder


def test_accelerate_rng_file_spelled_with_a_leading_zero_is_named_not_taken(tmp_path: Path) -> None:
    src = _copy(tmp_path, "accel_fsdp2")
    (src / "random_states_01.pkl").write_bytes(b"not rank 1's generator state")
    out = tmp_path / "out"
    run = run_ckptkit("reshard", src, out, "--to", "2")
    assert run.code == 0, run.detail()
    assert (out / "random_states_1.pkl").read_bytes() == (src / "random_states_1.pkl").read_bytes(), run.detail()
    assert "random_states_01.pkl" in run.output, run.detail()  # named as not understood, and copied
    assert (out / "random_states_01.pkl").exists(), run.detail()


def test_a_rank_name_with_a_trailing_line_break_does_not_replace_the_real_one(tmp_path: Path) -> None:
    src = _copy(tmp_path, "fsdp2")
    (src / "rng_state_1.pth\n").write_bytes(b"not rank 1's generator state")  # "$" matched before the "\n"
    out = tmp_path / "out"
    run = run_ckptkit("reshard", src, out, "--to", "2")
    assert run.code == 0, run.detail()
    assert (out / "rng_state_1.pth").read_bytes() == (src / "rng_state_1.pth").read_bytes(), run.detail()


def test_a_marker_listing_a_name_no_file_system_can_hold_is_a_stray(tmp_path: Path) -> None:
    """A lone surrogate (not an escaped byte) cannot be encoded for the OS: UnicodeEncodeError,
    a ValueError, not an OSError, just like a NUL."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    ck = ckptkit.Checkpointer(str(tmp_path / "run"))
    ck.save(1, model)
    marker = tmp_path / "run" / "step_000000001" / MARKER
    doc = json.loads(marker.read_text())
    doc["files"]["\ud800"] = 1
    marker.write_text(json.dumps(doc))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck.steps() == []
        assert ck.restore(model) is None
    run = run_ckptkit("inspect", tmp_path / "run")
    assert "internal error" not in run.output and "Traceback" not in run.output, run.detail()
    assert run.code in (0, 2), run.detail()


@pytest.mark.parametrize("entry", ["scheduler.pt", "rng_state_1.pth", "stray.txt"])
def test_verify_reports_an_entry_reshard_refuses_to_copy(tmp_path: Path, entry: str) -> None:
    src = _copy(tmp_path, "fsdp2")
    if (src / entry).exists():
        (src / entry).unlink()
    os.mkfifo(src / entry)
    run = run_ckptkit("verify", src)
    assert run.code == 1 and "FIFO" in run.output and entry in run.output, run.detail()
    assert "Traceback" not in run.output and "internal error" not in run.output, run.detail()
    run = run_ckptkit("reshard", src, tmp_path / "out", "--to", "2")
    assert run.code == 2 and entry in run.output, run.detail()  # the same folder reshard refuses


def test_verify_of_the_untouched_folder_is_still_ok(tmp_path: Path) -> None:
    run = run_ckptkit("verify", _copy(tmp_path, "fsdp2"))
    assert run.code == 0 and run.output.startswith("ok"), run.detail()
