"""DeepSpeed ZeRO checkpoints whose names clash are read as zero_to_fp32 reads them, or refused.

zero_to_fp32 fills one dict: buffers, then frozen parameters, then each group's trainable ones,
so a later name replaces an earlier one. Crafted from z2_fp32_w2's model-states file (rewritten
with torch.save, as DeepSpeed writes it): a frozen parameter or a buffer named like a trainable
parameter is read as zero_to_fp32 reads it, bit for bit; one name in two parameter groups is
refused under tests/helpers/hostile.py's whole contract (its pieces would not tile one tensor).
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers.agreement import DATA, assert_same, consolidated, needs, refused_everywhere

ZERO2 = DATA / "deepspeed" / "z2_fp32_w2"
MODEL_STATES = "global_step2/mp_rank_00_model_states.pt"


def _mutated(tmp: Path, mutate: Callable[[dict], None]) -> Path:
    needs(ZERO2)
    d = tmp / "ds"
    shutil.copytree(ZERO2, d)
    states = torch.load(d / MODEL_STATES, weights_only=False)  # trusted: our own copy of a fixture
    mutate(states)
    torch.save(states, d / MODEL_STATES)
    return d


def _zero_to_fp32(d: Path) -> dict[str, torch.Tensor]:
    zero_to_fp32 = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(d))


def _frozen_named_like_a_trainable(states: dict) -> None:
    frozen, trainable = states["frozen_param_shapes"], states["param_shapes"][0]
    old, new = next((f, t) for f, fs in frozen.items() for t, ts in trainable.items() if fs == ts)
    rename = lambda d: type(d)((new if k == old else k, v) for k, v in d.items())  # noqa: E731
    states["frozen_param_shapes"] = rename(frozen)
    states["frozen_param_fragments"] = rename(states["frozen_param_fragments"])


def _buffer_named_like_a_trainable(states: dict) -> None:
    name = next(iter(states["param_shapes"][0]))
    states["buffer_names"] = list(states["buffer_names"]) + [name]
    states["module"][name] = torch.zeros(states["param_shapes"][0][name])


@pytest.mark.parametrize(
    "mutate", [_frozen_named_like_a_trainable, _buffer_named_like_a_trainable], ids=["frozen", "buffer"]
)
def test_names_clashing_with_a_trainable_parameter_are_read_as_zero_to_fp32_reads_them(tmp_path, mutate):
    d = _mutated(tmp_path, mutate)
    truth = _zero_to_fp32(d)
    got = consolidated(d, tmp_path)
    assert_same(truth, {k.removeprefix("model."): v for k, v in got.items()})


def test_one_name_in_two_parameter_groups_is_refused(tmp_path):
    def twice(states: dict) -> None:
        first, second = states["param_shapes"][0], states["param_shapes"][1]
        old, new = next(iter(second)), list(first)[1]
        states["param_shapes"][1] = collections.OrderedDict((new if k == old else k, v) for k, v in second.items())

    d = _mutated(tmp_path, twice)
    refused_everywhere(d, tmp_path, str(d))


@pytest.mark.parametrize("stage", [1, 3])
def test_ranks_saying_two_zero_stages_are_refused(tmp_path, stage):
    """zero_to_fp32 takes rank 0's stage; ckptkit refuses a rank that says another."""
    needs(ZERO2)
    d = tmp_path / "ds"
    shutil.copytree(ZERO2, d)
    optim = d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    states = torch.load(optim, weights_only=False)  # trusted: our own copy of a fixture
    states["optimizer_state_dict"]["zero_stage"] = stage
    torch.save(states, optim)
    refused_everywhere(d, tmp_path, str(optim))
