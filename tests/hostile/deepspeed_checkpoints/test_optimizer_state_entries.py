"""Any optimizer's state in ZeRO files, made hostile: state keys that name the same entry are
refused, a large value kept for every parameter or a large tensor kept whole is refused quickly
and within the memory budget, and non-string keys and integer partitioned state survive a reshard.

Each case is crafted from the real fixtures the way an attacker or a careless user would break
them, run through the CLI in a subprocess (tests/helpers/hostile.py) and held to the contract of
docs/reliability.md.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers.hostile import Scene, check_refused, rss_bound, run_ckptkit

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fixtures" / "data"
DS_OPTIM = DATA / "deepspeed_optimizers" / "z2_clientadamw_bf16_w2"
TIMEOUT = 30.0


def _ds_with_state(tmp_path: Path, change) -> Path:
    """The real ZeRO-2 (client AdamW) fixture with each rank's group-0 state changed by `change`."""
    ckpt = tmp_path / "ds"
    shutil.copytree(DS_OPTIM, ckpt)
    for rank, path in enumerate(sorted(glob.glob(str(ckpt / "global_step2" / "*optim_states.pt")))):
        saved = torch.load(path, weights_only=False)  # trusted: the project's own fixture
        change(rank, saved["optimizer_state_dict"]["base_optimizer_state"]["state"][0])
        torch.save(saved, path)
    return ckpt


@pytest.mark.parametrize("cmd", ["inspect", "reshard"])
def test_state_keys_that_name_the_same_entry_are_refused(tmp_path: Path, cmd: str) -> None:
    # Without this check: keys 1 and "1" both became optim.state.<p>.1: reshard wrote 2.0 under both (1.0 lost), exit 0.
    def change(rank, state):
        state[1], state["1"] = torch.tensor(1.0), torch.tensor(2.0)

    ckpt = _ds_with_state(tmp_path, change)
    out = tmp_path / "out"
    scene = Scene(ckpt, out)
    args = ["inspect", ckpt] if cmd == "inspect" else ["reshard", ckpt, out, "--to", "3"]
    check_refused(run_ckptkit(*args, timeout=TIMEOUT), "zero_pp_rank_0", "name the same state", scene=scene)


def test_a_large_value_kept_for_every_parameter_is_refused_quickly(tmp_path: Path) -> None:
    # Without this check: a 2M-element list in one group's state (not partitioned, so kept for each of its 5
    # parameters) kept `inspect` walking 10M values for minutes (timed out at 30 s); convert took
    # 16 s, reshard 28 s.
    ckpt = _ds_with_state(tmp_path, lambda rank, state: state.__setitem__("history", list(range(300_000))))
    scene = Scene(ckpt)
    run = run_ckptkit("inspect", ckpt, timeout=TIMEOUT)
    check_refused(run, "zero_pp_rank_0", "'history'", "too large to keep for each", scene=scene)
    assert run.seconds < 15, run.detail()


def test_a_large_tensor_kept_whole_is_refused_within_the_memory_budget(tmp_path: Path) -> None:
    ckpt = _ds_with_state(tmp_path, lambda rank, state: state.__setitem__("big", torch.ones(3 << 20)))
    out = tmp_path / "out"
    scene = Scene(ckpt, out)
    budget = 32 << 20
    size = max(os.path.getsize(p) for p in glob.glob(str(ckpt / "global_step2" / "*optim_states.pt")))
    run = run_ckptkit("reshard", ckpt, out, "--to", "3", "--memory-budget", str(budget), timeout=TIMEOUT)
    check_refused(run, "optim_states.pt", "memory budget", scene=scene, rss_limit=rss_bound(budget, size))


def test_non_string_keys_and_integer_partitioned_state_survive_a_reshard(tmp_path: Path) -> None:
    # Kept, not refused: an int key (7) keeps its type, and an int64 state with the partition's
    # length is cut like the masters, bit for bit.
    def change(rank, state):
        state[7] = torch.tensor(7.0)
        state["counts"] = torch.arange(len(state["exp_avg"]), dtype=torch.int64) + 1000 * rank

    ckpt = _ds_with_state(tmp_path, change)
    before = torch.cat(
        [
            torch.load(p, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["counts"]
            for p in sorted(glob.glob(str(ckpt / "global_step2" / "*optim_states.pt")))
        ]
    )
    out = tmp_path / "out"
    run = run_ckptkit("reshard", ckpt, out, "--to", "3", timeout=TIMEOUT)
    assert run.code == 0, run.detail()
    states = [
        torch.load(p, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        for p in sorted(glob.glob(str(out / "global_step2" / "*optim_states.pt")))
    ]
    assert len(states) == 3 and all(7 in s and float(s[7]) == 7.0 for s in states)
    model_states = torch.load(ckpt / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    total = sum(shape.numel() for shape in model_states["param_shapes"][0].values())  # without the padding
    after = torch.cat([s["counts"] for s in states])
    assert after.dtype == torch.int64
    assert torch.equal(after[:total], before[:total]), "int64 state changed by the reshard"
