"""Hostile DeepSpeed universal checkpoints, made from a copy of a real ds_to_universal output
(fixtures/data/ds_universal/): each is refused under tests/helpers/hostile.py's whole contract
(exit 2, one sentence naming the file, RSS bound, time, source untouched, no output left) by
consolidate, by convert --to ds-universal, and verify --deep does not say ok; a pickle that
would run code runs nothing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import DATA
from helpers.agreement import refused_everywhere
from helpers.hostile import Scene, check_refused, run_ckptkit

UNIVERSAL = DATA / "ds_universal" / "z2_bf16_w2"
TAG = "global_step2_universal"
pytestmark = pytest.mark.skipif(
    not UNIVERSAL.exists(), reason="no universal fixture (fixtures/generate_ds_universal.py)"
)


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(tmp: Path) -> Path:
    d = tmp / "uc"
    shutil.copytree(UNIVERSAL, d)
    return d


def _truncate(d: Path) -> str:
    f = d / TAG / "zero" / "embed.weight" / "fp32.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return "embed.weight/fp32.pt"


def _missing_master(d: Path) -> str:
    (d / TAG / "zero" / "gate" / "fp32.pt").unlink()
    return "gate/fp32.pt"


def _state_of_another_shape(d: Path) -> str:
    f = d / TAG / "zero" / "norm.weight" / "exp_avg.pt"
    state = torch.load(f, weights_only=True)
    state["param"] = torch.zeros(11)
    torch.save(state, f)
    return "norm.weight/exp_avg.pt"


def _missing_global_state(d: Path) -> str:
    (d / TAG / "zero" / "optimizer_state.pt").unlink()
    return TAG


def _code_in_a_state_file(d: Path) -> str:
    f = d / TAG / "zero" / "pos" / "exp_avg_sq.pt"
    state = torch.load(f, weights_only=True)
    state["cat_dim"] = Evil(str(d.parent / "MARKER"))
    torch.save(state, f)
    return "pos/exp_avg_sq.pt"


def _code_in_the_step(d: Path) -> str:
    f = d / TAG / "zero" / "pos" / "step.pt"
    torch.save(Evil(str(d.parent / "MARKER")), f)
    return "pos/step.pt"


def _latest_leaving_the_folder(d: Path) -> str:
    (d / "latest_universal").write_text("../elsewhere")
    return "latest_universal"


CASES: dict[str, Callable[[Path], str]] = {
    "truncated fp32.pt": _truncate,
    "a parameter folder without its master": _missing_master,
    "a state of another shape than the model states say": _state_of_another_shape,
    "no zero/optimizer_state.pt": _missing_global_state,
    "a code global in a state file": _code_in_a_state_file,
    "a code global as the step": _code_in_the_step,
    "latest_universal naming a folder outside": _latest_leaving_the_folder,
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_universal_checkpoint_is_refused(tmp_path, case):
    d = _copy(tmp_path)
    named = CASES[case](d)
    refused_everywhere(d, tmp_path, named)
    out = tmp_path / "converted"
    check_refused(run_ckptkit("convert", d, out, "--to", "ds-universal"), named, scene=Scene(d, out))
    assert not (tmp_path / "MARKER").exists(), "a pickle ran code"
