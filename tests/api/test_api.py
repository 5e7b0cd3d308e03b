"""ckptkit.save / ckptkit.load / Checkpointer in one process (no torch.distributed): atomic saves
readable by torch's dcp.load, loading from every format ckptkit reads (a ZeRO checkpoint straight
into a torch model), retention, async saves, and the refusals."""

from __future__ import annotations

import os

import sys

import pytest
import torch

import ckptkit
from ckptkit.errors import FormatError, UsageError
from conftest import DATA, ROOT, assert_tensor_equal, load_truth
from helpers.ds_fixtures import DS_DATA, ds_fixtures

sys.path.insert(0, str(ROOT / "fixtures"))
import models  # noqa: E402


def _trained(seed: int = models.MODEL_SEED, steps: int = 2):
    model = models.make_model(seed)
    optim = models.make_optimizer(model)
    models.train_steps(model, optim, steps, models.DATA_SEED)
    return model, optim


def _state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _flat(model, optim) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(_state(model, optim))
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert_tensor_equal(a[k], b[k], k)
        else:
            assert a[k] == b[k], k


def test_save_is_dcp_and_load_restores(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, optim = _trained()
    ckptkit.save(_state(model, optim), str(tmp_path / "c"))
    fresh, fresh_optim = _trained(models.MODEL_SEED + 5, steps=1)
    state = _state(fresh, fresh_optim)
    ckptkit.load(state, str(tmp_path / "c"))
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(fresh, fresh_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_same(_flat(fresh, fresh_optim), _flat(model, optim))
    other, other_optim = _trained(models.MODEL_SEED + 9, steps=1)  # torch's own loader reads it too
    theirs = _state(other, other_optim)
    dcp.load(theirs, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert_tensor_equal(theirs["model"]["pos"], model.pos.detach(), "pos")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # committed, nothing left over


def test_load_reads_a_fsdp2_dcp_saved_at_another_world_size():
    model, optim = _trained(models.MODEL_SEED + 1, steps=1)
    state = _state(model, optim)
    ckptkit.load(state, str(DATA / "fsdp2_w3"))
    truth = load_truth("fsdp2_w3")
    assert_tensor_equal(state["model"]["embed.weight"], truth["model.embed.weight"], "embed")
    assert_tensor_equal(state["optim"]["state"]["gate"]["exp_avg"], truth["optim.state.gate.exp_avg"], "moment")
    assert state["optim"]["param_groups"][0]["lr"] == truth["optim.param_groups.0.lr"]


@pytest.mark.skipif("z2_fp32_w2" not in ds_fixtures(), reason="no DeepSpeed fixtures")
def test_load_reads_a_zero_checkpoint_into_a_torch_model():
    import deepspeed_models as dm
    import generate_convert as gc

    model = dm.make_model(dm.MODEL_SEED + 4)
    optim = gc.make_optimizer(model)
    gc.train(model, optim, 1)
    state = _state(model, optim)
    ckptkit.load(state, str(DS_DATA / "z2_fp32_w2"))
    truth = torch.load(DS_DATA / "z2_fp32_w2.truth.pt", weights_only=True)
    assert_tensor_equal(state["model"]["block.fc_in.weight"], truth["fp32.block.fc_in.weight"], "master")
    assert_tensor_equal(state["model"]["frozen.weight"], truth["frozen.frozen.weight"], "frozen")
    assert_tensor_equal(state["optim"]["state"]["pos"]["exp_avg_sq"], truth["exp_avg_sq.pos"], "moment")
    assert_tensor_equal(state["optim"]["state"]["pos"]["step"], torch.tensor(2.0), "step")


def test_load_fills_in_place_whatever_the_target_dtype_and_layout(tmp_path):
    """A contiguous CPU tensor of the saved dtype is read straight into its storage (a Parameter
    that requires grad too); another dtype is cast and a non-contiguous view is filled through a
    copy, each equal to what was saved and written through to the tensor the caller holds."""
    saved = {"w": torch.randn(6, 4), "b": torch.randn(5), "t": torch.randn(4, 6)}
    ckptkit.save(saved, str(tmp_path / "c"))
    param = torch.nn.Parameter(torch.zeros(6, 4))
    half = torch.zeros(5, dtype=torch.bfloat16)
    base = torch.zeros(6, 4)
    state = {"w": param, "b": half, "t": base.t()}  # "t": a transposed (non-contiguous) view
    ckptkit.load(state, str(tmp_path / "c"))
    assert state["w"] is param and state["b"] is half
    assert_tensor_equal(param.detach(), saved["w"], "w")
    assert_tensor_equal(half, saved["b"].to(torch.bfloat16), "b")
    assert_tensor_equal(base.t(), saved["t"], "t")
    assert param.requires_grad
    # a meta tensor holds no data: refused, not "filled" (a GPU target is filled by copy_, never
    # read into as host memory: test_hostile_hooks.test_load_fills_a_gpu_tensor, on a GPU)
    with pytest.raises(UsageError, match="meta device"):
        ckptkit.load({"w": torch.empty(6, 4, device="meta")}, str(tmp_path / "c"))


def test_load_names_missing_keys_and_shape_mismatches(tmp_path):
    model, optim = _trained(steps=1)
    state = _state(model, optim)
    state["model"]["not_there"] = torch.zeros(2)
    with pytest.raises(FormatError, match="not_there"):
        ckptkit.load(state, str(DATA / "fsdp2_w2"))
    bad = {"model": {"pos": torch.zeros(3, 3)}}
    with pytest.raises(FormatError, match=r"model\.pos has shape \[5, 10\]"):
        ckptkit.load(bad, str(DATA / "fsdp2_w2"))


def test_checkpointer_in_one_process(tmp_path):
    ck = ckptkit.Checkpointer(str(tmp_path / "run"), keep=2)
    assert ck.restore(*_trained(steps=1)) is None and ck.extra is None
    model, optim = _trained(steps=1)
    for step in (10, 20, 30):
        models.train_steps(model, optim, 1, models.DATA_SEED + step)
        ck.save(step, model, optim, extra={"epoch": step, "tags": ["a", "b"]})
    assert ck.steps() == [20, 30]
    fresh, fresh_optim = _trained(models.MODEL_SEED + 2, steps=1)
    assert ckptkit.Checkpointer(str(tmp_path / "run")).restore(fresh, fresh_optim) == 30
    _assert_same(_flat(fresh, fresh_optim), _flat(model, optim))
    # a crash mid-save leaves a hidden temporary; restore skips it and sweeps it away, and a lock
    # whose process is gone (a kill between taking the lock and creating the temporary) as well
    (tmp_path / "run" / ".step_000000040.ckptkit-tmp-deadbeef").mkdir()
    (tmp_path / "run" / ".step_000000050.ckptkit-lock").write_text("999999999")
    (tmp_path / "run" / ".step_000000060.ckptkit-lock").write_text(str(os.getpid()))  # held: kept
    again = ckptkit.Checkpointer(str(tmp_path / "run"))
    assert again.restore(fresh, fresh_optim) == 30 and again.extra == {"epoch": 30, "tags": ["a", "b"]}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ".step_000000060.ckptkit-lock",
        "latest",
        "step_000000020",
        "step_000000030",
    ]


def test_async_checkpointer_in_one_process(tmp_path):
    model, optim = _trained(steps=1)
    before = _flat(model, optim)
    ck = ckptkit.Checkpointer(str(tmp_path / "a"), async_save=True)
    ck.save(1, model, optim)
    models.train_steps(model, optim, 2, models.DATA_SEED + 1)
    ck.wait()
    fresh, fresh_optim = _trained(models.MODEL_SEED + 3, steps=1)
    assert ckptkit.Checkpointer(str(tmp_path / "a")).restore(fresh, fresh_optim) == 1
    _assert_same(_flat(fresh, fresh_optim), before)


def test_async_saves_copy_into_the_last_saves_staging_and_keep_their_own_values(tmp_path):
    """The second async save copies into the CPU buffers the first staged (no new memory for the
    state's size each save), yet every step restores the values of its own call: training goes on
    between the call and wait(), and the next save reuses buffers only after the last is written."""
    model, optim = _trained(steps=1)
    ck = ckptkit.Checkpointer(str(tmp_path / "a"), async_save=True, keep=5)
    truths, pointers = {}, []
    for step in (1, 2, 3):
        truths[step] = _flat(model, optim)
        ck.save(step, model, optim)
        pointers.append(list(ck._background.buffers))  # held: a new allocation could not land on a freed buffer
        models.train_steps(model, optim, 1, models.DATA_SEED + step)  # changes every tensor at once
    ck.wait()
    assert len(pointers[0]) > 4 and all(a is b is c for a, b, c in zip(*pointers))  # the same buffers each save
    for step, truth in truths.items():
        fresh, fresh_optim = _trained(models.MODEL_SEED + 3, steps=1)
        assert ckptkit.Checkpointer(str(tmp_path / "a")).restore(fresh, fresh_optim, step=step) == step
        _assert_same(_flat(fresh, fresh_optim), truth)


def test_staging_takes_new_memory_for_a_tensor_whose_layout_changed():
    from ckptkit.hooks.staging import stage

    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4)
    staged, made = stage({"a": a, "b": b})
    again, reused = stage({"a": a.t(), "b": b * 2}, made)  # a: other shape and strides; b: as before
    assert reused[1].data_ptr() == made[1].data_ptr() and torch.equal(again["b"], b * 2)
    assert reused[0].data_ptr() != made[0].data_ptr() and torch.equal(again["a"], a.t())
    assert again["a"].stride() == a.t().clone().stride()
    assert torch.equal(staged["a"], a)  # (the first staging of `a` was left alone)


def test_rank_0s_outcome_reaches_every_rank_in_one_broadcast(tmp_path):
    """The Checkpointer's rank-0 decisions (_on_root) send one broadcast: a result and a refusal
    arrive as themselves; a failure is raised on rank 0 and as a PeerError naming it elsewhere,
    and a failed group runs no further collective."""
    from ckptkit.errors import OutputError
    from ckptkit.runner.distributed import Group, PeerError

    sent: list = []

    class Root(Group):
        def share(self, obj):
            sent.append(obj)
            return obj

    class Peer(Group):
        def share(self, obj):
            assert obj == (None, None, None)  # the other ranks send nothing of their own
            return sent[-1]

    ck = ckptkit.Checkpointer(str(tmp_path / "run"))
    root, peer = Root(rank=0, world=2), Peer(rank=1, world=2)
    ran_on_peer = lambda: pytest.fail("only rank 0 runs the decision")  # noqa: E731
    assert ck._on_root(lambda: 42, root) == 42 and ck._on_root(ran_on_peer, peer) == 42
    with pytest.raises(OutputError, match="already"):
        ck._on_root(lambda: (_ for _ in ()).throw(OutputError("step 3 is already saved")), root)
    with pytest.raises(OutputError, match="already"):
        ck._on_root(ran_on_peer, peer)
    assert root.failed is None and peer.failed is None  # a refusal leaves the group usable
    with pytest.raises(ZeroDivisionError):
        ck._on_root(lambda: 1 / 0, root)
    with pytest.raises(PeerError, match="rank 0 failed: ZeroDivisionError"):
        ck._on_root(ran_on_peer, peer)
    shared = len(sent)
    with pytest.raises(ZeroDivisionError):  # the group failed: no collective runs again
        ck._on_root(lambda: 1, root)
    assert len(sent) == shared


def test_checkpointer_refuses_bad_arguments(tmp_path):
    with pytest.raises(UsageError):
        ckptkit.Checkpointer(str(tmp_path), keep=0)
    with pytest.raises(UsageError):
        ckptkit.Checkpointer(str(tmp_path)).save(-1, torch.nn.Linear(2, 2))


def test_the_documented_example_runs(tmp_path, monkeypatch):
    import re

    text = (ROOT / "docs" / "hooks.md").read_text()
    blocks = re.findall(r"<!-- run -->\n```python\n(.*?)```", text, re.S)
    assert blocks, "docs/hooks.md lost its runnable example"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/hooks.md", "exec"), {})


def test_pyproject_lets_setuptools_find_every_package():
    """A non-editable install ships every package: pyproject lists none by hand (setuptools finds
    each one under the folders package-dir maps), so a new subpackage cannot be left out.
    tests/packaging/test_wheel.py checks the built wheel's contents file by file."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "packages" not in config, "a hand-written package list can miss a new subpackage"
    assert config["package-dir"] == {"ckptkit": "ckptkit", "ckptkit_cli": "cli"}


@pytest.mark.parametrize("url", ["memory://bucket/ckpt", "s3://bucket/ckpt"])
def test_save_and_checkpointer_refuse_a_url_and_write_nothing(url, tmp_path, monkeypatch):
    """torch's writer fills a local folder: a URL would send the shards into the working directory
    (and the markers to the store). Refused before anything is written, anywhere."""
    from ckptkit.errors import UnsupportedError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UnsupportedError, match=r"^" + url + ": ckptkit.save writes to a local or mounted path, not a URL"
    ):
        ckptkit.save({"w": torch.ones(2)}, url)
    with pytest.raises(
        UsageError, match=r"^" + url + ": the Checkpointer saves to a local or mounted folder, not a URL"
    ):
        ckptkit.Checkpointer(url)
    assert os.listdir(tmp_path) == []
    if url.startswith("memory://"):
        import fsspec

        assert not fsspec.filesystem("memory").exists(url)
