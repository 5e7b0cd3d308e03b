"""DeepSpeedNative, the one index.native of every DeepSpeed checkpoint, read off the real fixtures:
its cells are the (stage, tp rank) grid of the files DeepSpeed wrote, each cell the ZeRO
checkpoint of its own model-parallel rank, and the views the writers use agree with them."""

from __future__ import annotations

import os

import pytest

from ckptkit.formats.deepspeed.layout import LAYER_FILES, DeepSpeedLayout
from ckptkit.formats.deepspeed.names import tp_suffix
from ckptkit.formats.deepspeed.native import DeepSpeedNative
from ckptkit.formats.registry import open_checkpoint
from conftest import DATA

FOLDERS = ("deepspeed", "ds_tp", "ds_pp", "ds_3d", "ds_moe", "ds_moe_tp", "ds_pp_moe")
REFUSED = {"ds_pp/pp2_dp1_z0_fp32", "ds_moe_tp/moetp_noexptp_z2_fp32_tp2_ep1_w4"}  # their own tests pin why


def _one_per_family() -> list[str]:
    """The first readable fixture of each folder, and every 3-D one (lanes of layer files)."""
    chosen = []
    for folder in FOLDERS:
        root = DATA / folder
        if not root.is_dir():
            continue
        found = [f"{folder}/{n}" for n in sorted(os.listdir(root)) if (root / n / "fixture.json").is_file()]
        found = [f for f in found if f not in REFUSED]
        chosen += found if folder == "ds_3d" else found[:1]
    return chosen


FIXTURES = _one_per_family()


@pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures in fixtures/data (fixtures/generate_*.py)")
@pytest.mark.parametrize("fixture", FIXTURES)
def test_cells_are_the_grid_of_the_files_deepspeed_wrote(fixture):
    index = open_checkpoint(str(DATA / fixture)).index
    native = index.native
    assert isinstance(native, DeepSpeedNative)
    layout = native.layout
    assert DeepSpeedLayout.of(index) is layout
    assert set(native.cells) == {(s, t) for s in range(layout.pp) for t in range(layout.tp)}
    for (s, t), cell in native.cells.items():
        assert cell.files.mp_rank == layout.mp_rank(s, t), (s, t)
        assert cell.world_size == layout.dp
    assert native.ranks == {layout.mp_rank(s, t): c for (s, t), c in native.cells.items()}
    assert native.stages == {s: native.cell(s, 0) for s in range(layout.pp)}
    for key, copies in native.replica_entries().items():
        assert key in index.tensors and copies


@pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures in fixtures/data (fixtures/generate_*.py)")
@pytest.mark.parametrize("fixture", [f for f in FIXTURES if f.startswith(("ds_pp/", "ds_3d/"))])
def test_each_tp_rank_lane_holds_its_own_layer_files(fixture):
    """A PipelineModule's lanes: tp rank t's layer files end with its tp suffix (at tp > 1), and its
    lane is a pipeline record of its own whose cells are that tp rank's stages."""
    native = open_checkpoint(str(DATA / fixture)).index.native
    assert native.layout.stages == LAYER_FILES
    assert sorted(native.pipelines) == list(range(native.tp))
    for t, lane in native.pipelines.items():
        assert lane.layout.tp == 1 and lane.layer_files
        assert lane.stages == {s: native.cell(s, t) for s in range(native.pp)}
        if native.tp > 1:
            assert all(name.endswith(f"{tp_suffix(t)}-model_states.pt") for name in lane.layer_files.values())
