"""Checkpointer(async_save=True) in one process: the staging buffers one save allocates serve the
next (which writes its own values into them), a save called while one is in flight, and what may
change while the optimizer's tensors are still being copied on the background thread:
optimizer.step() waits for the copy, a buffer changed by a forward is copied at the call, and any
other in-place change before the copy fails the save with nothing committed."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ckptkit
from ckptkit.hooks import staging
from ckptkit.hooks import StateChangedError
from conftest import assert_tensor_equal


def _model_and_optim(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, seed)
    return model, optim


def _forward_backward(model, seed: int) -> None:
    g = torch.Generator().manual_seed(1000 + seed)
    model(torch.randn(32, 8, generator=g)).square().mean().backward()


def _train(model, optim, seed: int) -> None:
    _forward_backward(model, seed)
    optim.step()
    optim.zero_grad()


def _flat(model, optim) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    flat, _ = flatten_state_dict({"model": msd, "optim": osd})
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}


def _restored(directory, step: int) -> dict:
    fresh, fresh_optim = _model_and_optim(seed=99)
    assert ckptkit.Checkpointer(directory).restore(fresh, fresh_optim, step=step) == step
    return _flat(fresh, fresh_optim)


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert_tensor_equal(got[k], want[k], k)
        else:
            assert got[k] == want[k], k


def _differs(a: dict, b: dict) -> bool:
    return any(isinstance(v, torch.Tensor) and not torch.equal(v, b[k]) for k, v in a.items())


@pytest.fixture
def copy_gate(monkeypatch):
    """Holds every async save's background copy until the test sets the returned event."""
    gate = threading.Event()
    real = staging.Staging.finish

    def finish(self):
        assert gate.wait(60), "the test never released the copy"
        return real(self)

    monkeypatch.setattr(staging.Staging, "finish", finish)
    return gate


def test_second_save_copies_its_own_values_into_the_first_saves_buffers(tmp_path):
    model, optim = _model_and_optim()
    ck = ckptkit.Checkpointer(tmp_path / "run", keep=5, async_save=True)
    truth1 = _flat(model, optim)
    ck.save(1, model, optim)
    first = list(ck._background.buffers)
    ck.wait()
    _train(model, optim, 1)
    truth2 = _flat(model, optim)
    assert _differs(truth1, truth2)  # else the check below could not tell stale values from new ones
    ck.save(2, model, optim)
    second = list(ck._background.buffers)
    ck.wait()
    assert len(first) > 6 and [b.data_ptr() for b in first] == [b.data_ptr() for b in second]
    _assert_same(_restored(tmp_path / "run", 2), truth2)
    _assert_same(_restored(tmp_path / "run", 1), truth1)


def test_a_save_called_while_one_is_in_flight_waits_for_it(tmp_path, monkeypatch):
    from ckptkit.hooks.checkpointer import Checkpointer

    written = threading.Event()  # holds the background write of every save until set
    real_write = Checkpointer._write

    def held_write(self, *args):
        assert written.wait(60), "the test never released the write"
        real_write(self, *args)

    monkeypatch.setattr(Checkpointer, "_write", held_write)
    model, optim = _model_and_optim()
    ck = ckptkit.Checkpointer(tmp_path / "run", keep=5, async_save=True)
    truth1 = _flat(model, optim)
    ck.save(1, model, optim)
    _train(model, optim, 1)  # waits only for step 1's copy; its write is still held
    truth2 = _flat(model, optim)
    assert ck.steps() == []  # step 1 is still in flight
    threading.Timer(0.3, written.set).start()
    ck.save(2, model, optim)  # waits until step 1 is written, then copies into its buffers
    assert ck.steps()[:1] == [1]
    _train(model, optim, 2)
    ck.wait()
    assert ck.steps() == [1, 2]
    _assert_same(_restored(tmp_path / "run", 1), truth1)
    _assert_same(_restored(tmp_path / "run", 2), truth2)


def test_optimizer_step_waits_for_the_copy_of_the_save_in_flight(tmp_path, copy_gate):
    model, optim = _model_and_optim()
    ck = ckptkit.Checkpointer(tmp_path / "run", async_save=True)
    truth = _flat(model, optim)
    ck.save(1, model, optim)
    assert not ck._background.staged.is_set()  # the optimizer's tensors are not copied yet
    _forward_backward(model, 1)  # allowed while the copy is pending: reads parameters, writes gradients
    released = threading.Timer(0.3, copy_gate.set)
    released.start()
    optim.step()  # would change every saved parameter and moment under the copy without the wait
    assert copy_gate.is_set() and ck._background.staged.is_set()
    optim.zero_grad()
    ck.wait()
    after = _flat(model, optim)
    assert _differs(after, truth)
    _assert_same(_restored(tmp_path / "run", 1), truth)


def test_a_buffer_a_forward_changes_is_copied_before_save_returns(tmp_path, copy_gate):
    model, optim = _model_and_optim()
    ck = ckptkit.Checkpointer(tmp_path / "run", async_save=True)
    truth = _flat(model, optim)
    ck.save(1, model, optim)
    _forward_backward(model, 1)  # train mode: BatchNorm's running statistics change in place
    assert not torch.equal(model[1].running_mean, truth["model.1.running_mean"])
    copy_gate.set()
    ck.wait()
    _assert_same(_restored(tmp_path / "run", 1), truth)


def test_an_in_place_change_before_the_copy_fails_the_save_and_commits_nothing(tmp_path, copy_gate):
    model, optim = _model_and_optim()
    ck = ckptkit.Checkpointer(tmp_path / "run", async_save=True)
    ck.save(1, model, optim)
    with torch.no_grad():
        model[0].weight.mul_(2)  # not through optimizer.step(): nothing waits for the copy
    copy_gate.set()
    with pytest.raises(StateChangedError, match=r"model\.0\.weight .*modified in place after save\(\) returned"):
        ck.wait()
    assert ck.steps() == [] and not [n for n in os.listdir(tmp_path / "run") if n.startswith(".")]
    truth = _flat(model, optim)
    ck.save(2, model, optim)  # the Checkpointer stays usable
    ck.wait()
    assert ck.steps() == [2]
    _assert_same(_restored(tmp_path / "run", 2), truth)


def test_a_change_after_wait_staged_is_not_in_the_checkpoint(tmp_path, copy_gate):
    model, optim = _model_and_optim()
    ck = ckptkit.Checkpointer(tmp_path / "run", async_save=True)
    truth = _flat(model, optim)
    ck.save(1, model, optim)
    copy_gate.set()
    ck.wait_staged()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    ck.wait()
    _assert_same(_restored(tmp_path / "run", 1), truth)


def test_a_save_without_the_optimizer_copies_everything_before_returning(tmp_path, copy_gate):
    model, optim = _model_and_optim()
    ck = ckptkit.Checkpointer(tmp_path / "run", async_save=True)
    truth = _flat(model, optim)
    ck.save(1, model)
    with torch.no_grad():
        model[0].weight.mul_(2)  # the Checkpointer knows no optimizer: nothing was left to copy later
    copy_gate.set()
    ck.wait()
    fresh, _ = _model_and_optim(seed=99)
    assert ckptkit.Checkpointer(tmp_path / "run").restore(fresh) == 1
    for k, v in fresh.state_dict().items():
        assert_tensor_equal(v, truth[f"model.{k}"], k)


def test_values_the_restorable_check_skips_are_read_back_by_the_restricted_loader():
    import io

    from ckptkit.hooks.saved import plain
    from ckptkit.runner.torch_archive import load_bytes_archive

    values = [0, -(2**70), 1.5, float("inf"), True, None, "lr", [0.9, 0.999], (1, "a", None), {"a": [1, (2.0,)]}, []]
    for value in values:
        assert plain(value), value
        buf = io.BytesIO()
        torch.save(value, buf)
        assert load_bytes_archive(buf.getvalue(), "value") == value
    assert not any(plain(v) for v in ({1: 2}, [object()], torch.tensor(1), (1, {2}), type("Int", (int,), {})(3)))
