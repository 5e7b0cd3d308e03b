"""The training API takes a checkpoint path as a str or any os.PathLike (pathlib.Path), as torch's
own dcp.save/load do, and refuses anything else in one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit import Checkpointer
from ckptkit.errors import UsageError


def test_checkpointer_takes_a_pathlib_path(tmp_path):
    model = torch.nn.Linear(3, 2)
    ckpt = Checkpointer(tmp_path / "run", keep=2)
    ckpt.save(1, model)
    assert ckpt.steps() == [1]
    fresh = torch.nn.Linear(3, 2)
    assert Checkpointer(Path(tmp_path / "run")).restore(fresh) == 1
    assert torch.equal(fresh.weight, model.weight)


def test_save_and_load_take_a_pathlib_path(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    ckptkit.save(state, tmp_path / "ck")
    into = {"w": torch.zeros(2, 3)}
    ckptkit.load(into, tmp_path / "ck")
    assert torch.equal(into["w"], state["w"])


@pytest.mark.parametrize("bad", [None, 3, b"/tmp/x", "", ["/tmp/x"]])
def test_a_path_that_is_no_path_is_one_sentence(bad):
    with pytest.raises(UsageError, match=r"^Checkpointer takes a checkpoint path \(a str or pathlib.Path\)"):
        Checkpointer(bad)
    with pytest.raises(UsageError, match=r"^ckptkit.load takes a checkpoint path"):
        ckptkit.load({}, bad)
    with pytest.raises(UsageError, match=r"^ckptkit.save takes a checkpoint path"):
        ckptkit.save({"w": torch.zeros(1)}, bad)
