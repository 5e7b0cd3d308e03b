"""A DCP `.metadata`'s planner_data path must join (with dots) to the name it is given, as torch's
flatten_state_dict makes it: torch's load rebuilds the state dict along these paths, and one that
names another place (another entry's path, a level more or less, a list index for a key) makes it
fail or put the value elsewhere, where ckptkit read on under the name."""

from __future__ import annotations

import pytest
import torch

from conftest import read_all, save_random_dcp
from helpers.oracle_dcp import dumps, framework_load, load_meta
from helpers.hostile import Scene, check_refused, run_ckptkit


def _mutated(tmp_path, change):
    src = tmp_path / "ckpt"
    save_random_dcp(src, 3, (4, 2), seed=5)
    meta = load_meta(src)
    change(meta.planner_data)
    (src / ".metadata").write_bytes(dumps(meta))
    return src


CHANGES = {
    "another-entrys-path": lambda pd: pd.update({"model.w0": pd["model.w1"]}),
    "one-level-less": lambda pd: pd.update({"model.w0": ("model",)}),
    "one-level-more": lambda pd: pd.update({"model.w0": ("model", "w0", "x")}),
    "list-index-for-a-key": lambda pd: pd.update({"model.w0": ("model", 0)}),
    "moved-under-another-container": lambda pd: pd.update({"model.w0": ("optim", "model.w0")}),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_planner_path_that_does_not_join_to_its_name_is_refused(tmp_path, change):
    src = _mutated(tmp_path, CHANGES[change])
    scene = Scene(src, tmp_path / "out")
    check_refused(run_ckptkit("verify", "--deep", str(src)), str(src), "planner_data", "model.w0", scene=scene, code=1)
    check_refused(run_ckptkit("consolidate", str(src), str(tmp_path / "out")), str(src), "planner_data", scene=scene)


def test_planner_paths_torch_writes_read_as_dcp_load_reads_them(tmp_path):
    src = tmp_path / "ckpt"
    state = save_random_dcp(src, 3, (4, 2), seed=5)
    opened, tensors, _ = read_all(src)
    theirs = framework_load(src)
    for name, value in state["model"].items():
        assert opened.index.tensors[f"model.{name}"].path == ("model", name)
        assert torch.equal(tensors[f"model.{name}"], theirs["model"][name])
