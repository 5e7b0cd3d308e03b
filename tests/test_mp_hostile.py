"""Red team for the model-parallel readers and writers (issue 14): hostile or careless variants of
the real TP / pipeline / MoE / mesh fixtures, each run through the CLI and held to the error
contract (exit 2, one `error: ` sentence naming the file and the key, no traceback, no OUT left).

Each case is a hole this red team found; the variants are crafted from copies of the committed
fixtures with torch's own pickle on the test side (trusted files we generated), as the other
hostile tests do.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers_corrupt import DATA, assert_error, run_cli

TAG = "global_step2"


def _edit(folder: Path, name: str, change: Callable[[dict], None]) -> None:
    path = folder / TAG / name
    obj = torch.load(path, weights_only=False)  # trusted: a copy of our own fixture
    change(obj)
    torch.save(obj, path)


def _tp_degree(value: int) -> Callable[[dict], None]:
    def change(obj: dict) -> None:
        obj["checkpoint_parallel_dimensions"]["tp_degree"] = value
    return change


def _tp_lost_ranks(folder: Path) -> None:
    """A 4-way TP checkpoint of which only mp ranks 0 and 1 were copied: the files say tp 4."""
    for name in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"):
        _edit(folder, name, _tp_degree(4))


# (id, fixture, crafting, command after SRC (OUT: the output folder), names the sentence must hold)
CASES = [
    ("tp-says-4-has-2", "ds_tp/mpu_z2_fp32", _tp_lost_ranks, ["consolidate", "SRC", "OUT"],
     ["mp_rank_00_model_states.pt", "tp_degree", "4", "2 mp ranks"]),
    ("tp-says-4-has-2-reshard", "ds_tp/mpu_z2_fp32", _tp_lost_ranks, ["reshard", "SRC", "OUT", "--to", "tp=1,dp=2"],
     ["mp_rank_00_model_states.pt", "tp_degree"]),
    ("tp-says-4-has-2-inspect", "ds_tp/autotp_z2_fp32", _tp_lost_ranks, ["inspect", "SRC"],
     ["mp_rank_00_model_states.pt", "tp_degree"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_model_parallel_input_is_one_sentence(tmp_path: Path, case) -> None:
    _, fixture, craft, command, names = case
    if not (DATA / fixture).is_dir():
        pytest.skip(f"fixture {fixture} not generated")
    src = tmp_path / "src"
    shutil.copytree(DATA / fixture, src)
    craft(src)
    out = tmp_path / "out"
    args = [str(src) if a == "SRC" else str(out) if a == "OUT" else a for a in command]
    res = run_cli(*args)
    assert_error(res, *names, out=out)
