"""ZeRO-3 placeholders (the empty tensors `module` holds for partitioned parameters) are skipped
without being located, yet one whose view tensor_location would refuse is still
refused with tensor_location's sentence."""

from __future__ import annotations

import shutil

import pytest
import torch

from ckptkit.errors import FormatError
from ckptkit.formats.registry import open_checkpoint
from ckptkit.runner import torch_archive
from helpers.ds_fixtures import DS_DATA, ds_fixtures

FIXTURES = ds_fixtures()
pytestmark = pytest.mark.skipif("z3_bf16_w2" not in FIXTURES, reason="no DeepSpeed ZeRO-3 fixture")


def _victim(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DS_DATA / "z3_bf16_w2", ckpt)
    victim = sorted((ckpt / "global_step2").glob("*model_states.pt"))[0]
    state = torch.load(victim, weights_only=False)  # trusted: our own fixture
    name = next(n for n, t in state["module"].items() if t.numel() == 0 and n not in state["buffer_names"])
    return ckpt, victim, state, name


def test_placeholders_are_not_located(tmp_path, monkeypatch):
    ckpt, _, state, name = _victim(tmp_path)
    located = []
    real = torch_archive.tensor_location
    monkeypatch.setattr(
        "ckptkit.formats.deepspeed.entries.tensor_location",
        lambda a, ref, what, *rest: (located.append(what), real(a, ref, what, *rest))[1],
    )
    index = open_checkpoint(str(ckpt)).index
    assert f"module[{name}]" not in located and f"model.{name}" in index.tensors
    assert not any(k.startswith("ds_module.") for k in index.tensors)


def test_a_placeholder_with_a_view_past_its_storage_is_still_refused(tmp_path):
    ckpt, victim, state, name = _victim(tmp_path)
    dtype = state["module"][name].dtype
    state["module"][name] = torch.zeros(2, dtype=dtype).as_strided((0,), (1,), 5)
    torch.save(state, victim)
    with pytest.raises(FormatError, match=rf"model_states.pt: tensor module\[{name}\] lies outside its storage member"):
        open_checkpoint(str(ckpt))
