"""The Checkpointer counts only complete checkpoints and never loses one, under attack and misuse.

One process, a real torch model + AdamW. A folder named like a newer step that is not a complete
checkpoint (empty, garbage, a half-written DCP, a file, a FIFO, a symbolic link, a copy of another
step, a forged or truncated marker) is skipped by restore with a warning naming it, and is never
deleted; keep=1 keeps the step just written; `step_11` and `step_000000011` are the same step, and
two complete folders for one step are an error naming both."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.errors import CkptkitError, OutputError, UsageError
from ckptkit.hooks import steps as step_folders
from ckptkit.hooks.checkpointer import SkippedStepsWarning
from ckptkit.hooks.steps import MARKER, DuplicateStepError
from conftest import ROOT, assert_tensor_equal
from helpers.deepspeed_engine import DS_FIXTURE, FakeEngine
from helpers.hostile import snapshot

sys.path.insert(0, str(ROOT / "fixtures"))
import models  # noqa: E402

TIMEOUT_S = 60


@contextmanager
def deadline(seconds: int = TIMEOUT_S):
    """A hang (a FIFO opened for reading) fails the test instead of stopping the suite."""

    def fire(*_):
        raise TimeoutError(f"did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _flat(model, optim) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    flat, _ = flatten_state_dict({"model": msd, "optim": osd})
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert_tensor_equal(got[k], want[k], k)
        else:
            assert got[k] == want[k], k


def _fresh(seed: int = models.MODEL_SEED + 11):
    model = models.make_model(seed)
    optim = models.make_optimizer(model)
    models.train_steps(model, optim, 1, models.DATA_SEED + 99)  # optimizer state exists to be filled
    return model, optim


def _run(directory: Path, steps=(1, 2), keep: int = 3):
    """A Checkpointer that saved `steps`, with the exact state of each (the truth to compare)."""
    model = models.make_model(models.MODEL_SEED)
    optim = models.make_optimizer(model)
    ck = ckptkit.Checkpointer(str(directory), keep=keep)
    truth = {}
    for step in steps:
        models.train_steps(model, optim, 1, models.DATA_SEED + step)
        ck.save(step, model, optim, extra={"epoch": step})
        truth[step] = _flat(model, optim)
    return ck, model, optim, truth


def _restore(directory: Path, **kw):
    fresh, fresh_optim = _fresh()
    ck = ckptkit.Checkpointer(str(directory))
    with deadline():
        step = ck.restore(fresh, fresh_optim, **kw)
    return step, _flat(fresh, fresh_optim), ck.extra


def _data_file(folder: Path) -> Path:
    return next(p for p in sorted(folder.iterdir()) if p.name.endswith(".distcp"))


# ---- the strays an attacker or a careless user leaves, each newer than the real steps ----------


def _empty(d: Path, real: Path) -> None:
    (d / "step_99").mkdir()


def _garbage(d: Path, real: Path) -> None:
    (d / "step_99").mkdir()
    (d / "step_99" / ".metadata").write_bytes(os.urandom(4096))
    (d / "step_99" / "__0_0.distcp").write_bytes(os.urandom(8192))


def _half_written_dcp(d: Path, real: Path) -> None:  # the data files are there, .metadata never came
    shutil.copytree(real, d / "step_99")
    (d / "step_99" / ".metadata").unlink()
    (d / "step_99" / MARKER).unlink()


def _a_file(d: Path, real: Path) -> None:
    (d / "step_99").write_bytes(b"not a folder")


def _a_fifo(d: Path, real: Path) -> None:
    os.mkfifo(d / "step_99")


def _symlink_to_a_real_checkpoint(d: Path, real: Path) -> None:
    shutil.copytree(real, d.parent / "elsewhere")
    os.symlink(d.parent / "elsewhere", d / "step_99")


def _copy_of_another_step(d: Path, real: Path) -> None:  # complete, but its marker says step 2
    shutil.copytree(real, d / "step_99")


def _copy_without_marker(d: Path, real: Path) -> None:  # a DCP whose ckptkit.step record is 2
    shutil.copytree(real, d / "step_000000099")
    (d / "step_000000099" / MARKER).unlink()


def _truncated_under_a_marker(d: Path, real: Path) -> None:
    shutil.copytree(real, d / "step_99")
    _retag(d / "step_99", 99)
    data = _data_file(d / "step_99")
    data.write_bytes(data.read_bytes()[:100])


def _marker_listing_outside(d: Path, real: Path) -> None:
    shutil.copytree(real, d / "step_99")
    doc = _retag(d / "step_99", 99)
    doc["files"]["../step_000000002/.metadata"] = (real / ".metadata").stat().st_size
    (d / "step_99" / MARKER).write_text(json.dumps(doc))


def _marker_not_json(d: Path, real: Path) -> None:
    shutil.copytree(real, d / "step_99")
    (d / "step_99" / MARKER).write_bytes(b"\x80{not json" * 10)


def _marker_huge(d: Path, real: Path) -> None:  # sparse: must be refused by size, not read
    shutil.copytree(real, d / "step_99")
    with open(d / "step_99" / MARKER, "wb") as f:
        f.truncate(64 << 20)  # over the 16 MiB cap


def _marker_is_a_fifo(d: Path, real: Path) -> None:
    shutil.copytree(real, d / "step_99")
    (d / "step_99" / MARKER).unlink()
    os.mkfifo(d / "step_99" / MARKER)


def _metadata_is_a_fifo(d: Path, real: Path) -> None:
    (d / "step_99").mkdir()
    os.mkfifo(d / "step_99" / ".metadata")


def _link_inside(d: Path, real: Path) -> None:  # a marked copy whose data file points elsewhere
    shutil.copytree(real, d / "step_99")
    _retag(d / "step_99", 99)
    data = _data_file(d / "step_99")
    data.unlink()
    os.symlink(_data_file(real), data)


def _retag(folder: Path, step: int) -> dict:
    doc = json.loads((folder / MARKER).read_text())
    doc["step"] = step
    (folder / MARKER).write_text(json.dumps(doc))
    return doc


STRAYS = [
    _empty,
    _garbage,
    _half_written_dcp,
    _a_file,
    _a_fifo,
    _symlink_to_a_real_checkpoint,
    _copy_of_another_step,
    _copy_without_marker,
    _truncated_under_a_marker,
    _marker_listing_outside,
    _marker_not_json,
    _marker_huge,
    _marker_is_a_fifo,
    _metadata_is_a_fifo,
    _link_inside,
]


@pytest.mark.parametrize("make_stray", STRAYS, ids=[f.__name__.strip("_") for f in STRAYS])
def test_restore_skips_a_newer_stray_names_it_and_loads_the_newest_complete_step(tmp_path, make_stray):
    d = tmp_path / "run"
    ck, _, _, truth = _run(d)
    make_stray(d, Path(ck.path(2)))
    stray = next(n for n in os.listdir(d) if step_folders.step_of(n) == 99)
    before = snapshot(d / stray)
    with deadline():
        assert ck.steps() == [1, 2]
    with pytest.warns(SkippedStepsWarning) as caught:
        step, got, extra = _restore(d)
    assert step == 2 and extra == {"epoch": 2}
    _assert_same(got, truth[2])
    message = str(caught[0].message)
    assert stray in message and "step 2" in message and "\n" not in message
    assert snapshot(d / stray) == before, "restore touched the stray"
    # retention leaves it alone too, and never deletes the step just written
    ck1 = ckptkit.Checkpointer(str(d), keep=1)
    model, optim = _fresh(models.MODEL_SEED + 3)
    with deadline():
        ck1.save(3, model, optim)
    assert ck1.steps() == [3] and snapshot(d / stray) == before
    with pytest.warns(SkippedStepsWarning, match=stray):
        step, got, _ = _restore(d)
    assert step == 3
    _assert_same(got, _flat(model, optim))


def test_keep_1_with_a_stray_newer_folder_keeps_the_step_just_written(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "step_000000099").mkdir()  # a newer stray folder
    (d / "step_98").write_text("a user's note")  # a newer stray file
    (d / "notes.txt").write_text("keep me")
    others = {n: snapshot(d / n) for n in os.listdir(d)}
    ck, model, optim, truth = _run(d, steps=(1, 2, 3), keep=1)
    assert ck.steps() == [3]
    assert {n: snapshot(d / n) for n in others} == others
    assert sorted(os.listdir(d)) == sorted([*others, "latest", "step_000000003"])  # no hidden leftovers either
    with pytest.warns(SkippedStepsWarning, match="step_000000099.*step_98"):
        step, got, extra = _restore(d)
    assert step == 3 and extra == {"epoch": 3}
    _assert_same(got, truth[3])


def test_retention_keeps_the_step_just_written_even_when_older_than_the_kept_ones(tmp_path):
    d = tmp_path / "run"
    ck, model, optim, truth = _run(d, steps=(5, 6), keep=1)
    assert ck.steps() == [6]
    ck.save(2, model, optim)  # an older step, written after a restore(step=...) for instance
    assert ck.steps() == [2, 6]


def test_retention_never_deletes_a_checkpoint_without_marker(tmp_path):
    d = tmp_path / "run"
    ck, model, optim, truth = _run(d, steps=(1,), keep=1)
    os.unlink(os.path.join(ck.path(1), MARKER))  # as the previous ckptkit version wrote it
    assert ck.steps() == [1]
    for step in (2, 3):
        ck.save(step, model, optim)
    assert ck.steps() == [1, 3]
    step, got, _ = _restore(d, step=1)
    assert step == 1
    _assert_same(got, truth[1])


def test_unpadded_step_names_are_the_same_step(tmp_path):
    d = tmp_path / "run"
    ck, model, optim, truth = _run(d, steps=(11,))
    os.rename(d / "step_000000011", d / "step_11")
    assert ck.steps() == [11] and ck.path(11) == str(d / "step_11")
    step, got, extra = _restore(d)
    assert step == 11 and extra == {"epoch": 11}
    _assert_same(got, truth[11])
    fresh, fresh_optim = _fresh()
    state = {"model": fresh.state_dict()}
    ckptkit.load(state, ck.path(11))  # open works with either spelling
    assert_tensor_equal(state["model"]["pos"], truth[11]["model.pos"], "model.pos")
    with pytest.raises(OutputError, match=r"step_11: step 11 is already saved"):
        ck.save(11, model, optim)
    models.train_steps(model, optim, 1, models.DATA_SEED + 5)
    ck.save(11, model, optim, overwrite=True)  # replaces step_11, adds no second spelling
    assert sorted(os.listdir(d)) == ["latest", "step_11"] and ck.steps() == [11]
    step, got, _ = _restore(d)
    _assert_same(got, _flat(model, optim))
    os.rename(d / "step_11", d / "step_0011")
    ck.save(12, model, optim)
    assert ck.steps() == [11, 12] and ck.path(11) == str(d / "step_0011")


def test_two_complete_folders_for_one_step_are_an_error_naming_both(tmp_path):
    d = tmp_path / "run"
    ck, model, optim, truth = _run(d, steps=(10, 11))
    shutil.copytree(d / "step_000000011", d / "step_11")
    for call in (lambda: _restore(d), ck.steps, lambda: ck.path(11), lambda: ck.save(11, model, optim, overwrite=True)):
        with pytest.raises(DuplicateStepError) as info:
            call()
        assert isinstance(info.value, CkptkitError)
        text = str(info.value)
        assert "step_11" in text and "step_000000011" in text and "\n" not in text
    assert ck.path(10) == str(d / "step_000000010")
    # an incomplete second spelling is a stray, not an ambiguity
    shutil.rmtree(d / "step_11")
    (d / "step_11").mkdir()
    with pytest.warns(SkippedStepsWarning, match="step_11"):
        step, got, _ = _restore(d)
    assert step == 11
    _assert_same(got, truth[11])


def test_restore_a_chosen_step(tmp_path):
    d = tmp_path / "run"
    ck, _, _, truth = _run(d, steps=(1, 2, 3))
    (d / "step_7").mkdir()
    step, got, extra = _restore(d, step=2)
    assert step == 2 and extra == {"epoch": 2}
    _assert_same(got, truth[2])
    for missing in (5, 7):
        with pytest.raises(UsageError, match=rf"no complete checkpoint of step {missing} .*1, 2, 3"):
            _restore(d, step=missing)
    with pytest.raises(UsageError):
        _restore(d, step=-1)


def test_save_refuses_to_replace_what_is_there_unless_overwrite(tmp_path):
    d = tmp_path / "run"
    ck, model, optim, truth = _run(d, steps=(1,))
    before = snapshot(d)
    with pytest.raises(OutputError, match=r"step_000000001: step 1 is already saved.*overwrite=True"):
        ck.save(1, model, optim)
    assert snapshot(d) == before
    (d / "step_4").write_text("mine")
    with pytest.raises(OutputError, match=r"step_4: is in the way of step 4 .*leaves it alone"):
        ck.save(4, model, optim)
    assert (d / "step_4").read_text() == "mine" and ck.steps() == [1]
    ck.save(4, model, optim, overwrite=True)
    assert ck.steps() == [1, 4] and sorted(os.listdir(d)) == ["latest", "step_000000001", "step_4"]


def test_the_marker_is_written_last_and_describes_the_folder(tmp_path, monkeypatch):
    d = tmp_path / "run"
    ck, model, optim, _ = _run(d, steps=(3,))
    folder = Path(ck.path(3))
    doc = json.loads((folder / MARKER).read_text())
    assert doc["step"] == 3 and doc["format"] == "dcp" and doc["world_size"] == 1 and doc["ckptkit"]
    listed = {
        str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != MARKER
    }
    assert doc["files"] == listed and ".metadata" in listed
    # a save that fails before or while the marker is written leaves no step folder at all
    import ckptkit.hooks.steps as mod

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mod, "write_marker", broken)
    with pytest.raises(OutputError, match="no space left on device"):
        ck.save(4, model, optim)
    assert sorted(os.listdir(d)) == ["latest", "step_000000003"]


def test_restore_puts_back_a_step_a_kill_left_aside_while_replacing_it(tmp_path):
    d = tmp_path / "run"
    ck, _, _, truth = _run(d, steps=(1, 2))
    # RenameOutput.commit (where the system cannot swap two folders) renames the old folder aside,
    # then the new one in; a kill in between: the new one is a hidden temporary, the old aside
    os.rename(d / "step_000000002", d / ".step_000000002.ckptkit-old-0badc0de")
    shutil.copytree(d / "step_000000001", d / ".step_000000002.ckptkit-tmp-0badc0de")
    step, got, _ = _restore(d)
    assert step == 2 and sorted(os.listdir(d)) == ["latest", "step_000000001", "step_000000002"]
    _assert_same(got, truth[2])
    # a kill after both renames: the aside copy (also as older versions named it) is removed
    shutil.copytree(d / "step_000000001", d / ".step_000000001.ckptkit-old-0badc0de")
    shutil.copytree(d / "step_000000001", d / "step_000000002.ckptkit-old-0badc0de")
    (d / ".step_000000001.ckptkit-lock").write_text("999999999")  # its dead owner's lock
    assert _restore(d)[0] == 2 and sorted(os.listdir(d)) == ["latest", "step_000000001", "step_000000002"]
    _assert_same(_restore(d, step=1)[1], truth[1])


# ---- DeepSpeed engines: marker after DeepSpeed's own save; a stand-in engine, no deepspeed -------


@pytest.mark.skipif(not DS_FIXTURE.exists(), reason="no DeepSpeed fixtures")
def test_deepspeed_engine_steps_get_a_marker_and_strays_are_skipped(tmp_path):
    d = tmp_path / "run"
    ck = ckptkit.Checkpointer(str(d), keep=1)
    engine = FakeEngine()
    for step in (4, 5):
        ck.save(step, engine, {"epoch": 7})
    assert ck.steps() == [5]
    doc = json.loads((d / "step_000000005" / MARKER).read_text())
    assert doc["format"] == "deepspeed" and doc["step"] == 5 and "latest" in doc["files"]
    shutil.copytree(d / "step_000000005", d / "step_6")  # a copy: its marker says step 5
    (d / "step_7").mkdir()
    (d / "step_7" / "latest").write_text("global_step7")  # DeepSpeed's save died before its files
    fresh = FakeEngine()
    with pytest.warns(SkippedStepsWarning, match="step_7.*step_6"):
        with deadline():
            assert ckptkit.Checkpointer(str(d)).restore(fresh) == 5
    assert fresh.loaded == [(str(d / "step_000000005"), "global_step5")]
    os.unlink(d / "step_000000005" / MARKER)  # as the previous ckptkit wrote it
    fresh = FakeEngine()
    with pytest.warns(SkippedStepsWarning):
        assert ckptkit.Checkpointer(str(d)).restore(fresh) == 5
