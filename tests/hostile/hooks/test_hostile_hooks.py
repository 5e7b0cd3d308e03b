"""Hostile inputs to the Checkpointer's RNG files and arguments and to ckptkit.load, beyond
test_hostile_folders: each refusal is one CkptkitError naming the culprit, raised before anything
was changed (the model, the state dict, every random generator)."""

from __future__ import annotations

import json
import random
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptkit
from ckptkit.errors import CkptkitError, FormatError, UsageError
from ckptkit.hooks import rng as rng_files
from conftest import ROOT, saved_checkpointer_step, subprocess_env, torchrun_cmd

MARKER = ".ckptkit-complete"


def _damage(step_dir: Path, mutate) -> None:
    path = step_dir / rng_files.file_name(0)
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    (step_dir / MARKER).unlink()  # the marker's sizes would catch it first; unmarked steps are still read


def _generators() -> tuple:
    return random.getstate(), torch.get_rng_state(), np.random.get_state(legacy=False)


def _same_generators(a: tuple, b: tuple) -> bool:
    return (
        a[0] == b[0]
        and torch.equal(a[1], b[1])
        and a[2]["state"]["pos"] == b[2]["state"]["pos"]
        and np.array_equal(a[2]["state"]["key"], b[2]["state"]["key"])
    )


DAMAGE = {
    # numpy takes any position and then reads outside its 624-word key: never handed to it
    "numpy pos -1": lambda d: d["numpy"].__setitem__("pos", -1),
    "numpy pos past the key": lambda d: d["numpy"].__setitem__("pos", 700),
    "numpy has_gauss 2": lambda d: d["numpy"].__setitem__("has_gauss", 2),
    "numpy gauss text": lambda d: d["numpy"].__setitem__("gauss", "x"),
    "numpy key word over 32 bits": lambda d: d["numpy"]["key"].__setitem__(0, 2**40),
    "python gauss text": lambda d: d["python"].__setitem__("gauss", "x"),
    "python index past the state": lambda d: d["python"]["state"].__setitem__(-1, 10**6),
    "python not a dict": lambda d: d.__setitem__("python", [3]),
    "torch state a number": lambda d: d.__setitem__("torch", 5),
    "torch state empty": lambda d: d.__setitem__("torch", ""),
    "torch state of the right size, no mt19937": lambda d: d.__setitem__("torch", "00" * 5056),
    "cuda without a device": lambda d: d.__setitem__("cuda", {"state": "00"}),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_refused_rng_file_changes_neither_the_model_nor_any_generator(tmp_path: Path, damage: str) -> None:
    ck, _model, _optim, step_dir = saved_checkpointer_step(tmp_path)
    _damage(step_dir, DAMAGE[damage])
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    weights = model.weight.detach().clone()
    before = _generators()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(FormatError, match=r"rank_00000\.json"):
            ck.restore(model, optim)
    assert torch.equal(model.weight.detach(), weights), "the model was loaded before the RNG file was refused"
    assert _same_generators(_generators(), before), "a refused RNG file changed a generator"


@pytest.mark.slow
def test_two_ranks_refuse_one_ranks_bad_rng_file_together_and_stay_usable(tmp_path: Path) -> None:
    """Rank 1's file is refused on both ranks at the same call, nothing changed, then save and
    restore go on (tests/dist/hostile_rng_job.py)."""
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(2) + [
        str(ROOT / "tests" / "dist" / "hostile_rng_job.py"),
        "--dir",
        str(tmp_path / "run"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(result.read_text())
    assert doc["ok"], doc


def test_a_good_rng_file_still_puts_every_generator_back(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    ck, _model, _optim, _ = saved_checkpointer_step(tmp_path)  # seeds torch with 0 before saving
    saved = _generators()
    random.random(), np.random.rand(), torch.rand(3)
    model = torch.nn.Linear(4, 4)
    assert ck.restore(model, torch.optim.AdamW(model.parameters())) == 1
    assert _same_generators(_generators(), saved)


@pytest.mark.parametrize("keep", [0, -1, True, 2.0, [3]])
def test_keep_must_be_a_positive_int(tmp_path: Path, keep) -> None:
    with pytest.raises(UsageError, match="keep"):
        ckptkit.Checkpointer(str(tmp_path / "run"), keep=keep)


def test_keep_one_still_keeps_one(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    ck = ckptkit.Checkpointer(str(tmp_path / "run"), keep=1)
    ck.save(1, model)
    ck.save(2, model)
    assert ck.steps() == [2]


def test_load_names_a_tensor_where_the_state_dict_holds_a_value(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ckptkit.save({"w": torch.arange(4.0), "step": torch.tensor(5)}, path)
    sd = {"w": torch.zeros(4), "step": 0}
    with pytest.raises(FormatError, match=r"step is a tensor in the checkpoint, the state dict holds int"):
        ckptkit.load(sd, path)
    assert torch.equal(sd["w"], torch.zeros(4)) and sd["step"] == 0, "a refused load changed the state dict"


def test_load_still_replaces_values_and_fills_tensors(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ckptkit.save({"w": torch.arange(4.0), "step": 5, "t": torch.tensor(7)}, path)
    sd = {"w": torch.zeros(4), "step": 0, "t": torch.tensor(0)}
    ckptkit.load(sd, path)
    assert torch.equal(sd["w"], torch.arange(4.0)) and sd["step"] == 5 and int(sd["t"]) == 7


def test_a_refused_load_fills_nothing(tmp_path: Path) -> None:
    """A shape that differs in a later key is refused before an earlier key is filled."""
    path = str(tmp_path / "ck")
    ckptkit.save({"a": torch.arange(4.0), "b": torch.arange(3.0)}, path)
    sd = {"a": torch.zeros(4), "b": torch.zeros(5)}
    with pytest.raises(FormatError, match=r"\bb has shape \[3\]"):
        ckptkit.load(sd, path)
    assert torch.equal(sd["a"], torch.zeros(4))


def test_load_into_meta_says_to_materialise_and_fills_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    ckptkit.save({"a": torch.arange(4.0), "b": torch.arange(4.0)}, path)
    sd = {"a": torch.zeros(4), "b": torch.empty(4, device="meta")}
    with pytest.raises(UsageError, match=r"b is a tensor on the meta device.*to_empty"):
        ckptkit.load(sd, path)
    assert torch.equal(sd["a"], torch.zeros(4))


def test_restore_into_a_meta_model_is_refused(tmp_path: Path) -> None:
    ck, _model, _optim, _ = saved_checkpointer_step(tmp_path)
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    before = _generators()
    with pytest.raises(CkptkitError, match=r"model\.weight is a tensor on the meta device.*to_empty"):
        ck.restore(model, torch.optim.AdamW(model.parameters()))
    assert _same_generators(_generators(), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_load_fills_a_gpu_tensor(tmp_path: Path) -> None:
    """A target off the CPU is filled by copy_, never read into as host memory."""
    path = str(tmp_path / "ck")
    ckptkit.save({"w": torch.arange(24.0).reshape(6, 4)}, path)
    target = torch.zeros(6, 4, device="cuda")
    ckptkit.load({"w": target}, path)
    assert torch.equal(target.cpu(), torch.arange(24.0).reshape(6, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_generator_state_is_checked_and_put_back(tmp_path: Path) -> None:
    torch.rand(1, device="cuda")  # CUDA in use: the step saves its generator
    ck, _model, _optim, step_dir = saved_checkpointer_step(tmp_path)
    saved = torch.cuda.get_rng_state()
    torch.rand(8, device="cuda")
    model = torch.nn.Linear(4, 4)
    assert ck.restore(model, torch.optim.AdamW(model.parameters())) == 1
    assert torch.equal(torch.cuda.get_rng_state(), saved)
    _damage(step_dir, lambda d: d["cuda"].__setitem__("state", "00"))
    with pytest.raises(FormatError, match=r"rank_00000\.json"):
        ck.restore(model, torch.optim.AdamW(model.parameters()))
