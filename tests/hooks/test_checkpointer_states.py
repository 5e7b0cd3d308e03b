"""The Checkpointer as a user expects it: `states` (a scheduler, a stateful object),
per-rank RNG state, tensors in `extra`, the pointer file `latest`, no warning in one process, and
`ckptkit inspect DIR`. One process with a real model + AdamW + StepLR, each promise bit for bit;
then one short 2-rank job (tests/dist/checkpointer_states_job.py) checking the same per rank."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import ckptkit
from ckptkit.errors import FormatError, UsageError
from ckptkit.hooks import pointer
from ckptkit.hooks import rng as rng_files
from ckptkit.hooks.checkpointer import SkippedStepsWarning
from ckptkit.hooks.rng import RngNotRestoredWarning
from conftest import ROOT, assert_tensor_equal, subprocess_env, torchrun_cmd

sys.path.insert(0, str(ROOT / "fixtures"))
import models  # noqa: E402


class Counter:
    """A stateful object as a dataloader would be: a position, a tensor and a list."""

    def __init__(self, start: int = 0) -> None:
        self.position = start
        self.seen = torch.arange(start, start + 3, dtype=torch.int64)
        self.history = [start]

    def advance(self) -> None:
        self.position += 7
        self.seen = self.seen + 1
        self.history.append(self.position)

    def state_dict(self) -> dict:
        return {"position": self.position, "seen": self.seen.clone(), "history": list(self.history)}

    def load_state_dict(self, sd: dict) -> None:
        self.position, self.seen, self.history = sd["position"], sd["seen"], list(sd["history"])


def _flat(model, optim) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict

    flat, _ = flatten_state_dict(dict(zip(("model", "optim"), get_state_dict(model, optim))))
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert_tensor_equal(got[k], v, k)
        else:
            assert got[k] == v, k


def _job(seed: int = models.MODEL_SEED):
    model = models.make_model(seed)
    optim = models.make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched, Counter(seed % 100)


def _train(model, optim, sched, counter, n: int, data_seed: int) -> None:
    for i in range(n):
        models.train_steps(model, optim, 1, data_seed + i)
        sched.step()
        counter.advance()


def _draws() -> tuple:
    """The next random numbers of every generator the Checkpointer restores."""
    return random.random(), float(np.random.rand()), torch.rand(4), torch.randint(0, 1 << 30, (3,))


def _seed(n: int) -> None:
    random.seed(n), np.random.seed(n), torch.manual_seed(n)


def _same_draws(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


def _no_warnings(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = fn()
    assert not seen, [f"{w.category.__name__}: {w.message}" for w in seen]
    return result


def test_states_rng_and_extra_tensors_round_trip_bit_for_bit(tmp_path):
    d = str(tmp_path / "run")
    model, optim, sched, counter = _job()
    _train(model, optim, sched, counter, 3, models.DATA_SEED)
    _seed(5)
    extra = {
        "epoch": 2,
        "ema": torch.randn(3, 2, dtype=torch.bfloat16),
        "nested": {"ids": torch.arange(5)},
        "pair": [torch.ones(2), torch.zeros(1, dtype=torch.float64)],
        "name": "run-a",
    }
    ck = ckptkit.Checkpointer(d)
    _no_warnings(lambda: ck.save(3, model, optim, extra=extra, states={"sched": sched, "data": counter}))
    want = (_flat(model, optim), sched.state_dict(), counter.state_dict(), optim.param_groups[0]["lr"])
    after_save = _draws()
    _train(model, optim, sched, counter, 2, models.DATA_SEED + 10)  # the run goes on; then a crash

    _seed(99)
    fresh, fresh_optim, fresh_sched, fresh_counter = _job(models.MODEL_SEED + 5)
    again = ckptkit.Checkpointer(d)
    step = _no_warnings(lambda: again.restore(fresh, fresh_optim, states={"sched": fresh_sched, "data": fresh_counter}))
    assert step == 3
    assert _same_draws(_draws(), after_save), "the next random draws are not those after the save"
    _assert_same(_flat(fresh, fresh_optim), want[0])
    assert fresh_sched.state_dict() == want[1] and fresh_optim.param_groups[0]["lr"] == want[3]
    got_counter = fresh_counter.state_dict()
    assert_tensor_equal(got_counter.pop("seen"), want[2].pop("seen"), "seen")
    assert got_counter == want[2]
    got = again.extra
    assert set(got) == set(extra) and got["epoch"] == 2 and got["name"] == "run-a"
    assert_tensor_equal(got["ema"], extra["ema"], "ema")
    assert_tensor_equal(got["nested"]["ids"], extra["nested"]["ids"], "nested.ids")
    assert len(got["pair"]) == 2
    for a, b in zip(got["pair"], extra["pair"]):
        assert_tensor_equal(a, b, "pair")


def test_restored_scheduler_continues_like_the_uninterrupted_run(tmp_path):
    model, optim, sched, counter = _job()
    ck = ckptkit.Checkpointer(str(tmp_path / "run"))
    _train(model, optim, sched, counter, 3, models.DATA_SEED)
    ck.save(3, model, optim, states={"sched": sched})
    lrs = []
    for _ in range(4):
        sched.step()
        lrs.append(sched.get_last_lr())
    fresh, fresh_optim, fresh_sched, _ = _job(models.MODEL_SEED + 1)
    ck.restore(fresh, fresh_optim, states={"sched": fresh_sched})
    fresh_lrs = []
    for _ in range(4):
        fresh_sched.step()
        fresh_lrs.append(fresh_sched.get_last_lr())
    assert fresh_lrs == lrs and len(set(map(tuple, lrs))) > 1


def test_states_refusals(tmp_path):
    model, optim, sched, counter = _job()
    ck = ckptkit.Checkpointer(str(tmp_path / "run"))
    with pytest.raises(UsageError, match=r"states\['x'\]: object has no state_dict"):
        ck.save(1, model, optim, states={"x": object()})
    with pytest.raises(UsageError, match="without dots"):
        ck.save(1, model, optim, states={"a.b": sched})
    assert ck.steps() == []
    ck.save(1, model, optim, states={"sched": sched})
    with pytest.raises(FormatError, match=r"holds no state 'data' \(states saved: sched\)"):
        ck.restore(model, optim, states={"sched": sched, "data": counter})


def test_rng_is_left_alone_with_a_warning_at_another_world_size_and_with_rng_false(tmp_path):
    d = tmp_path / "run"
    model, optim, *_ = _job()
    ck = ckptkit.Checkpointer(str(d))
    ck.save(1, model, optim)
    saved = json.loads((d / "step_000000001" / rng_files.file_name(0)).read_text())
    assert saved["world_size"] == 1 and saved["rank"] == 0 and set(saved) >= {"python", "numpy", "torch"}
    # as if 2 ranks had saved: this one-process run must not take rank 0's generators
    saved["world_size"] = 2
    (d / "step_000000001" / rng_files.file_name(0)).write_text(json.dumps(saved))
    _seed(3)
    before = _draws()
    _seed(3)
    with pytest.warns(RngNotRestoredWarning, match="saved at world size 2, this run has 1"):
        ckptkit.Checkpointer(str(d)).restore(model, optim, step=1)
    assert _same_draws(_draws(), before), "the generators changed"
    # rng=False: neither saved nor restored, without a warning
    off = ckptkit.Checkpointer(str(tmp_path / "off"), rng=False)
    off.save(1, model, optim)
    assert not (tmp_path / "off" / "step_000000001" / "rng").exists()
    _seed(4)
    before = _draws()
    _seed(4)
    _no_warnings(lambda: off.restore(model, optim))
    assert _same_draws(_draws(), before)
    with pytest.warns(RngNotRestoredWarning, match="saved without RNG state"):
        ckptkit.Checkpointer(str(tmp_path / "off")).restore(model, optim)


def test_a_damaged_rng_file_is_an_error_naming_it(tmp_path):
    d = tmp_path / "run"
    model, optim, *_ = _job()
    ck = ckptkit.Checkpointer(str(d))
    ck.save(1, model, optim)
    path = d / "step_000000001" / rng_files.file_name(0)
    doc = json.loads(path.read_text())
    doc["python"]["state"] = ["x"]
    path.write_text(json.dumps(doc))
    (d / "step_000000001" / ".ckptkit-complete").unlink()  # else the marker's sizes catch it first
    with pytest.raises(FormatError, match=r"rank_00000\.json: is not a ckptkit RNG state"):
        ck.restore(model, optim)
    doc = json.loads(path.read_text())
    doc["python"]["state"] = [1]
    doc["world_size"] = "\x1b[2J2"
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"rank_00000\.json: is not a ckptkit RNG state \('world_size is not"):
        ck.restore(model, optim)


def test_pointer_file_names_the_newest_complete_step_and_restore_falls_back(tmp_path):
    d = tmp_path / "run"
    model, optim, *_ = _job()
    ck = ckptkit.Checkpointer(str(d), keep=2)
    for step in (1, 2, 3):
        ck.save(step, model, optim)
        assert (d / "latest").read_text() == f"step_{step:09d}\n"
    ck.save(1, model, optim)  # an older step: the pointer still names the newest
    assert (d / "latest").read_text() == "step_000000003\n" and ck.steps() == [1, 2, 3]
    assert not [n for n in os.listdir(d) if n.startswith(".")], "the pointer's temporary was left"
    assert pointer.read(str(d)) == "step_000000003"
    # a crash between the commit of step 4 and the pointer update: the pointer names step 3
    ck.save(4, model, optim)
    (d / "latest").write_text("step_000000003\n")
    assert ckptkit.Checkpointer(str(d)).restore(model, optim) == 4
    # the pointer names a folder that is not complete, or that is not there, or is garbage
    for content in ("step_000000005\n", "step_7\n", "../../etc\n", "\x00\xff" * 600):
        if content == "step_000000005\n":
            (d / "step_000000005").mkdir()
        (d / "latest").write_bytes(content.encode("latin-1"))
        if content == "step_000000005\n":
            with pytest.warns(SkippedStepsWarning, match="step_000000005"):
                assert ckptkit.Checkpointer(str(d)).restore(model, optim) == 4
            (d / "step_000000005").rmdir()
        else:
            assert ckptkit.Checkpointer(str(d)).restore(model, optim) == 4
    # a link or a FIFO in its place is not followed nor opened for reading
    os.unlink(d / "latest")
    os.symlink(d / "step_000000004", d / "latest")
    assert pointer.read(str(d)) is None and ckptkit.Checkpointer(str(d)).restore(model, optim) == 4
    os.unlink(d / "latest")
    os.mkfifo(d / "latest")
    assert pointer.read(str(d)) is None and ckptkit.Checkpointer(str(d)).restore(model, optim) == 4
    os.unlink(d / "latest")
    ck.save(5, model, optim)
    assert (d / "latest").read_text() == "step_000000005\n"
    # a kill between writing the pointer's temporary and renaming it: restore removes a dead
    # process's temporary, never a live one's
    (d / ".latest.tmp-999999999-0badc0de").write_text("step_000000004\n")
    (d / f".latest.tmp-{os.getpid()}-0badc0de").write_text("step_000000005\n")
    assert ckptkit.Checkpointer(str(d)).restore(model, optim) == 5
    assert sorted(n for n in os.listdir(d) if n.startswith(".")) == [f".latest.tmp-{os.getpid()}-0badc0de"]


def test_a_pointer_that_cannot_be_written_leaves_the_step_saved(tmp_path, monkeypatch):
    d = tmp_path / "run"
    model, optim, *_ = _job()
    ck = ckptkit.Checkpointer(str(d))
    ck.save(1, model, optim)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pointer, "write", full)
    with pytest.warns(UserWarning, match=r"could not update latest to step_000000002 \(No space left"):
        ck.save(2, model, optim)
    assert ck.steps() == [1, 2] and (d / "latest").read_text() == "step_000000001\n"
    assert ckptkit.Checkpointer(str(d)).restore(model, optim) == 2


def test_no_warning_in_one_process(tmp_path):
    model, optim, sched, counter = _job()
    _train(model, optim, sched, counter, 1, models.DATA_SEED)
    for async_save in (False, True):
        ck = ckptkit.Checkpointer(str(tmp_path / f"run{async_save}"), keep=1, async_save=async_save)
        for step in (1, 2):
            _no_warnings(lambda: ck.save(step, model, optim, extra={"t": torch.ones(2)}, states={"s": sched}))
        _no_warnings(ck.wait)
        _no_warnings(lambda: ck.restore(model, optim, states={"s": sched}))
    _no_warnings(lambda: ckptkit.save({"model": model.state_dict()}, str(tmp_path / "plain")))


def test_deepspeed_engines_keep_states_in_client_state(tmp_path):
    from helpers.deepspeed_engine import DS_FIXTURE, FakeEngine

    if not DS_FIXTURE.exists():
        pytest.skip("no DeepSpeed fixtures")

    class Engine(FakeEngine):
        def save_checkpoint(self, save_dir, tag=None, client_state=None):
            self.client = client_state
            return super().save_checkpoint(save_dir, tag, client_state)

        def load_checkpoint(self, load_dir, tag=None, **kw):
            self.loaded.append((load_dir, tag))
            return load_dir, dict(saved_client)

    model, optim, sched, counter = _job()
    _train(model, optim, sched, counter, 1, models.DATA_SEED)
    engine = Engine()
    ck = ckptkit.Checkpointer(str(tmp_path / "run"))
    _seed(11)
    ck.save(4, engine, extra={"epoch": 2}, states={"sched": sched, "data": counter})
    after_save = _draws()
    saved_client = dict(engine.client)
    assert saved_client["epoch"] == 2 and set(saved_client["ckptkit_states"]) == {"sched", "data"}
    assert (tmp_path / "run" / "step_000000004" / rng_files.file_name(0)).exists()
    _, _, fresh_sched, fresh_counter = _job(models.MODEL_SEED + 3)
    _seed(12)
    again = ckptkit.Checkpointer(str(tmp_path / "run"))
    assert again.restore(Engine(), states={"sched": fresh_sched, "data": fresh_counter}) == 4
    assert again.extra == {"epoch": 2} and fresh_sched.state_dict() == sched.state_dict()
    assert fresh_counter.position == counter.position
    assert _same_draws(_draws(), after_save)


def test_inspect_lists_the_steps_of_a_checkpointer_directory(tmp_path):
    d = tmp_path / "run"
    model, optim, *_ = _job()
    ck = ckptkit.Checkpointer(str(d), keep=3)
    for step in (1, 2):
        ck.save(step, model, optim)
    (d / "step_9").mkdir()
    (d / "step_10").write_text("a note")
    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", "inspect", str(d)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == f"checkpointer  {d}"
    assert out[1] == "steps         2 complete of 4 folder(s) named like steps"
    assert out[2] == "newest        step 2 (step_000000002)"
    assert out[3] == "pointer       latest -> step_000000002"
    rows = {line.split()[1]: line for line in out[6:]}
    assert set(rows) == {"step_000000001", "step_000000002", "step_9", "step_10"}
    assert rows["step_000000002"].split()[2:4] == ["dcp", "1"] and rows["step_000000002"].endswith("complete")
    assert "skipped: is an empty folder without .ckptkit-complete" in rows["step_9"]
    assert "skipped: is not a folder" in rows["step_10"]
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", "inspect", str(d), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    doc = json.loads(proc.stdout)
    assert doc["newest_complete"] == 2 and doc["latest"] == "step_000000002"
    by_folder = {r["folder"]: r for r in doc["steps"]}
    size = sum(p.stat().st_size for p in (d / "step_000000002").rglob("*") if p.is_file())
    assert by_folder["step_000000002"]["bytes"] == size and by_folder["step_000000002"]["complete"]
    assert by_folder["step_9"]["complete"] is False and by_folder["step_9"]["format"] == "-"
    # a single step folder is still inspected as the checkpoint it is
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", "inspect", str(d / "step_000000001")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0 and "format      dcp" in proc.stdout


class _Position42:
    """What tests/dist/checkpointer_states_job.py's Position saves, at value 42."""

    def state_dict(self) -> dict:
        return {"value": 42, "seen": torch.tensor([42, 43])}

    def load_state_dict(self, sd: dict) -> None:
        raise AssertionError("not restored here")


@pytest.mark.slow
def test_two_ranks_states_rng_extra_tensors_and_pointer(tmp_path):
    job = ROOT / "tests" / "dist" / "checkpointer_states_job.py"
    result = tmp_path / "result.json"
    model = models.make_model(models.MODEL_SEED)
    optim = models.make_optimizer(model)
    models.train_steps(model, optim, 1, models.DATA_SEED)
    ckptkit.Checkpointer(str(tmp_path / "one")).save(1, model, optim, states={"pos": _Position42()})
    cmd = torchrun_cmd(2) + [
        str(job),
        "--dir",
        str(tmp_path / "run"),
        "--one",
        str(tmp_path / "one"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(result.read_text())
    assert doc["ok"], doc
    assert doc["world_size"] == 2 and doc["step"] == 3 and doc["compared"] >= 60
    assert doc["latest"] == "step_000000003\n" and sorted(doc["rng_files"]) == ["rank_00000.json", "rank_00001.json"]
    assert doc["draws_differ_between_ranks"]
