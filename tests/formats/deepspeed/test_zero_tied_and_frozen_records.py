"""ZeRO model-states records that describe one tensor twice must agree, or the checkpoint is
refused: a `shared_params` tie naming a parameter the checkpoint holds itself (zero_to_fp32
overwrites the held values with the owner's, ckptkit kept the held ones), and a stage-2 frozen
fragment whose own shape differs from `frozen_param_shapes` (zero_to_fp32 takes the fragment's,
ckptkit took the listed one)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from conftest import DATA
from helpers.hostile import Scene, check_refused, run_ckptkit


def _edited(tmp_path, fixture, change):
    """A copy of a DeepSpeed fixture (ours: loaded with weights_only=False) with its model files changed."""
    dst = tmp_path / fixture
    shutil.copytree(DATA / "deepspeed" / fixture, dst, copy_function=os.link)
    for path in dst.rglob("*model_states.pt"):
        state = torch.load(path, weights_only=False)  # noqa: S614 - a fixture of this repository
        change(state)
        path.unlink()  # a hard link to the fixture: replaced, never written through
        torch.save(state, path)
    return dst


@pytest.mark.parametrize("fixture", ["z2_fp32_w2", "z3_fp32_w2"])
@pytest.mark.parametrize(
    "tie",
    [{"pos": "gate"}, {"block.fc_in.bias": "norm.bias"}, {"positions": "pos"}],
    ids=["parameter", "same-shape-parameter", "buffer"],
)
def test_a_tie_naming_a_held_tensor_is_refused(tmp_path, fixture, tie):
    src = _edited(tmp_path, fixture, lambda m: m["shared_params"].update(tie))
    alias = next(iter(tie))
    scene = Scene(src, tmp_path / "out")
    check_refused(run_ckptkit("consolidate", str(src), str(tmp_path / "out")), "shared_params", alias, scene=scene)


def test_a_stage2_frozen_fragment_of_another_shape_is_refused(tmp_path):
    def reverse(m):
        shapes = m["frozen_param_shapes"]
        shapes["frozen.weight"] = torch.Size(list(shapes["frozen.weight"])[::-1])

    src = _edited(tmp_path, "z2_fp32_w2", reverse)
    scene = Scene(src, tmp_path / "out")
    check_refused(
        run_ckptkit("consolidate", str(src), str(tmp_path / "out")),
        "frozen fragment frozen.weight",
        "frozen_param_shapes",
        scene=scene,
    )


def test_the_fixtures_own_tie_is_still_an_alias(tmp_path):
    from ckptkit.ops.consolidate import consolidate

    result = consolidate(str(DATA / "deepspeed" / "z2_fp32_w2"), str(tmp_path / "out"))
    assert result.aliases == {"lm_head.weight": "embed.weight"}
