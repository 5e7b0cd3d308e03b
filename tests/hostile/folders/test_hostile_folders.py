"""Hostile Trainer folders and hostile inputs to the Checkpointer / ckptkit.save / ckptkit.load.

Each case is crafted from a real fixture (copied into tmp_path, never modified in place) or from a
checkpoint saved by the Checkpointer in this process, the way an attacker or a careless user would
break it, and held to the promise of README.md / docs/reliability.md: one sentence naming the
file and a non-zero exit (a CkptkitError from the API), never a traceback, never a silently wrong
value, nothing left that looks complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.errors import CkptkitError
from ckptkit.hooks import rng as rng_files
from conftest import saved_checkpointer_step
from helpers.hostile import Scene, check_refused, run_ckptkit

ROOT = Path(__file__).resolve().parents[3]
FSDP = ROOT / "fixtures" / "data" / "trainer" / "fsdp2" / "checkpoint-2"
MARKER = ".ckptkit-complete"


def _trainer(tmp_path: Path, name: str = "checkpoint-2") -> Path:
    """A copy of the accelerate-FSDP2 HF Trainer checkpoint folder (world size 2)."""
    folder = tmp_path / name
    shutil.copytree(FSDP, folder)
    return folder


# ---- Trainer folders: RNG files -------------------------------------------------------------------


def test_a_second_rng_file_for_one_rank_is_named_not_dropped(tmp_path: Path) -> None:
    src = _trainer(tmp_path)
    (src / "rng_state_01.pth").write_bytes(b"a different generator state")
    out = tmp_path / "out"
    run = run_ckptkit("reshard", src, out, "--to", "2")
    # refused naming it, or written/copied and named: never silently gone
    assert "rng_state_01.pth" in run.output or (out / "rng_state_01.pth").exists(), run.detail()


def test_a_rank_spelled_in_other_digits_does_not_replace_the_real_one(tmp_path: Path) -> None:
    src = _trainer(tmp_path)
    (src / "rng_state_\uff11.pth").write_bytes(b"not rank 1's generator state")
    run = run_ckptkit("inspect", "--json", src)
    assert run.code == 0, run.detail()
    listed = json.dumps(json.loads(run.stdout)["metadata"]["hf_trainer"], ensure_ascii=False)
    out = tmp_path / "out"
    run = run_ckptkit("reshard", src, out, "--to", "2")
    assert run.code == 0, run.detail()
    assert (out / "rng_state_1.pth").read_bytes() == (src / "rng_state_1.pth").read_bytes(), run.detail()
    assert "rng_state_1.pth" in listed and "rng_state_\uff11.pth" in listed, listed


# ---- Trainer folders: what held ------------------------------------------------------------------


def test_escape_sequences_in_an_entry_name_are_not_printed_raw(tmp_path: Path) -> None:
    src = _trainer(tmp_path)
    (src / "evil\x1b]0;pwn\x07\nok: forged").write_bytes(b"x")
    for cmd in ("inspect", "verify"):
        run = run_ckptkit(cmd, src)
        assert run.code == 0, run.detail()
        assert "\x1b" not in run.output and "\x07" not in run.output, run.detail()
        assert not any(line.startswith("ok: forged") for line in run.output.splitlines()), run.detail()


@pytest.mark.parametrize("step", ["1" + "0" * 5000, "-3", "NaN", '"2"', "2.0", "true"])
def test_a_global_step_that_is_not_a_count_stops_reshard_in_one_sentence(tmp_path: Path, step: str) -> None:
    src = _trainer(tmp_path)
    (src / "trainer_state.json").write_text('{"global_step": %s}' % step)
    out = tmp_path / "out"
    scene = Scene(src, out)
    run = run_ckptkit("reshard", src, out, "--to", "3")
    check_refused(run, "trainer_state.json", scene=scene)
    assert not out.exists()


@pytest.mark.parametrize("make", ["loop", "outside_file", "outside_dir"])
def test_a_link_inside_a_trainer_folder_stops_reshard_and_writes_nothing(tmp_path: Path, make: str) -> None:
    src = _trainer(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET")
    if make == "loop":
        os.symlink(".", src / "loop")
    elif make == "outside_file":
        os.symlink(secret, src / "notes.txt")
    else:
        os.symlink(tmp_path, src / "more")
    out = tmp_path / "out"
    scene = Scene(src, out)
    run = run_ckptkit("reshard", src, out, "--to", "2")
    check_refused(run, str(src), scene=scene)
    assert "SECRET" not in run.output


# ---- Checkpointer: RNG files that are JSON of the right shape but not a generator state ----------


def _damage_rng(step_dir: Path, mutate) -> Path:
    path = step_dir / rng_files.file_name(0)
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    (step_dir / MARKER).unlink()  # else the marker's sizes may catch it first; unmarked steps are still read
    return path


RNG_DAMAGE = {
    "python state of one word": lambda d: d["python"].__setitem__("state", [1]),
    "python state version 99": lambda d: d["python"].__setitem__("version", 99),
    "python gauss missing": lambda d: d["python"].pop("gauss"),
    "python words over 32 bits": lambda d: d["python"].__setitem__("state", [2**70] * 625),
    "torch state of one byte": lambda d: d.__setitem__("torch", "00"),
    "numpy key of one word": lambda d: d["numpy"].__setitem__("key", [1]),
    "numpy another generator": lambda d: d["numpy"].__setitem__("bit_generator", "PCG64"),
}


@pytest.mark.parametrize("damage", list(RNG_DAMAGE))
def test_an_rng_file_that_is_no_generator_state_is_an_error_naming_it(tmp_path: Path, damage: str) -> None:
    ck, model, optim, step_dir = saved_checkpointer_step(tmp_path)
    _damage_rng(step_dir, RNG_DAMAGE[damage])
    before = random.getstate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CkptkitError, match=r"rank_00000\.json"):
            ck.restore(model, optim)
    assert random.getstate() == before, "a refused RNG file changed the python generator"


# ---- Checkpointer: a marker listing a path no file system accepts ---------------------------------


def _nul_marker(step_dir: Path) -> None:
    marker = step_dir / MARKER
    doc = json.loads(marker.read_text())
    doc["files"]["a\u0000b"] = 1
    marker.write_text(json.dumps(doc))


@pytest.mark.parametrize("call", ["restore", "steps", "save"])
def test_a_marker_listing_a_name_with_a_nul_is_a_stray_not_a_crash(tmp_path: Path, call: str) -> None:
    ck, model, optim, step_dir = saved_checkpointer_step(tmp_path)
    _nul_marker(step_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if call == "restore":
                assert ck.restore(model, optim) is None  # the only step is a stray: a fresh start
            elif call == "steps":
                assert ck.steps() == []
            else:
                ck.save(2, model, optim)
                assert ck.steps() == [2]
        except CkptkitError:
            pass  # a refusal in one sentence is also kept to the promise


def test_inspect_of_a_checkpointer_directory_with_a_nul_in_a_marker(tmp_path: Path) -> None:
    _ck, _model, _optim, step_dir = saved_checkpointer_step(tmp_path)
    _nul_marker(step_dir)
    run = run_ckptkit("inspect", tmp_path / "run")
    assert "internal error" not in run.output and "Traceback" not in run.output, run.detail()
    assert run.code in (0, 2), run.detail()


# ---- Checkpointer: keep that is not a count ------------------------------------------------------


@pytest.mark.parametrize("keep", [1.5, float("nan"), "3", None])
def test_keep_that_is_not_a_positive_int_is_refused(tmp_path: Path, keep) -> None:
    with pytest.raises(ckptkit.errors.UsageError, match="keep"):
        ckptkit.Checkpointer(str(tmp_path / "run"), keep=keep)


# ---- ckptkit.load: values left as they were ------------------------------------------------------


def test_load_never_leaves_a_stale_value_where_the_checkpoint_has_a_tensor(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ckptkit.save({"w": torch.arange(4.0), "step": torch.tensor(5)}, path)
    sd = {"w": torch.zeros(4), "step": 0}
    try:
        ckptkit.load(sd, path)
    except CkptkitError:
        return  # refusing (a tensor where the state dict has an int) keeps the promise too
    assert torch.equal(sd["w"], torch.arange(4.0))
    assert int(sd["step"]) == 5, f"step left at {sd['step']!r}"


def test_load_into_a_meta_tensor_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ckptkit.save({"w": torch.arange(4.0)}, path)
    with pytest.raises(CkptkitError, match="w"):
        ckptkit.load({"w": torch.empty(4, device="meta")}, path)


# ---- ckptkit.load / Checkpointer: what held -------------------------------------------------------


def test_restore_into_other_shapes_or_keys_names_the_key(tmp_path: Path) -> None:
    ck, _model, _optim, _ = saved_checkpointer_step(tmp_path)
    wide = torch.nn.Linear(4, 5)
    with pytest.raises(ckptkit.errors.FormatError, match=r"model\.weight has shape \[4, 4\]"):
        ck.restore(wide, torch.optim.AdamW(wide.parameters()))
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ckptkit.errors.FormatError, match=r"has no model\.0\.weight"):
        ck.restore(seq, torch.optim.AdamW(seq.parameters()))
    sgd = torch.optim.SGD(_model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ckptkit.errors.FormatError, match=r"has no optim\.(state|param_groups)\."):
        ck.restore(_model, sgd)


def test_a_pointer_naming_a_missing_step_falls_back_to_the_newest_complete(tmp_path: Path) -> None:
    ck, model, optim, _ = saved_checkpointer_step(tmp_path)
    (tmp_path / "run" / "latest").write_text("step_000000007\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck.restore(model, optim) == 1
