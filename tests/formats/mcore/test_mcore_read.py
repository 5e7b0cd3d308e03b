"""Megatron-Core torch_dist checkpoints, written by megatron-core itself on CPU
(fixtures/make_mcore_fixtures.py), read as they are: the save root and an iteration folder, model
and optimizer told apart, the layout from `args`, every model tensor equal bit for bit to what
MCore's own dist_checkpointing.load gives a TP1 PP1 model (the fixtures' truth files)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ckptkit.formats.registry import detect, open_checkpoint
from ckptkit.ops.diff import diff
from ckptkit.runner.fetch import Fetcher
from ckptkit_cli.main import cli
from conftest import DATA

MCORE = DATA / "mcore"
DIST = ["tp2_swiglu_gqa", "pp2_tied", "tp2dp2_distopt", "tp2dp2_distopt_full"]
ITER = "iter_0000002"


def _truth(name: str) -> dict:
    return torch.load(MCORE / f"{name}.truth.pt", weights_only=True)


@pytest.mark.parametrize("name", DIST)
def test_every_model_tensor_equals_mcores_own_load_at_tp1_pp1(name):
    truth = _truth(name)
    opened = open_checkpoint(str(MCORE / name))
    fetcher = Fetcher(opened.source, index=opened.index)
    assert truth["tensors"]
    for state_name, expected in truth["tensors"].items():
        key, layer = truth["where"][state_name]
        got = fetcher.fetch(opened.index.tensors[key])
        if layer is not None:
            got = got[layer]
        assert got.dtype == expected.dtype and got.shape == expected.shape, state_name
        assert torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8)), state_name


@pytest.mark.parametrize("name", DIST)
def test_the_save_root_and_the_iteration_folder_read_alike(name):
    root = open_checkpoint(str(MCORE / name))
    folder = open_checkpoint(str(MCORE / name / ITER))
    assert root.index.format == folder.index.format == "mcore"
    assert detect(folder.source) == ["mcore"]
    assert set(root.index.tensors) == set(folder.index.tensors)
    assert root.index.step == folder.index.step == 2
    assert diff(str(MCORE / name), str(MCORE / name / ITER)).equal


def test_inspect_shows_model_and_optimizer_apart_and_the_layout():
    run = CliRunner().invoke(cli, ["inspect", str(MCORE / "tp2_swiglu_gqa")])
    assert run.exit_code == 0, run.output
    lines = run.output.splitlines()
    assert "format      mcore" in lines
    assert "parallel    tp 2 x pp 1 x ep 1 x dp 1" in lines
    assert "step        2" in lines
    # 16 model tensors; exp_avg and exp_avg_sq of each, and Adam's step kept once in common.pt
    assert any(ln.startswith("tensors     49 ") and ln.endswith(": 16 model, 33 optimizer, 0 other") for ln in lines)
    assert (
        "note        Megatron-Core torch_dist checkpoint: 16 model tensors, 33 optimizer (32 per-parameter "
        "state, 1 shared by all parameters); layers 2, output layer tied to the embedding: no" in lines
    )


@pytest.mark.parametrize("name", DIST)
def test_the_note_counts_what_the_summary_counts(name):
    run = CliRunner().invoke(cli, ["inspect", "--json", str(MCORE / name)])
    assert run.exit_code == 0, run.output
    doc = json.loads(run.output)
    roles = doc["summary"]["roles"]
    note = next(n for n in doc["summary"]["notes"] if n.startswith("Megatron-Core torch_dist checkpoint:"))
    assert f": {roles['model']} model tensors, {roles['optimizer']} optimizer (" in note
    keys = [t["key"] for t in doc["tensors"]]
    per_param = sum(".optimizer.state." in f".{k}" and k.split(".")[-1] != "common_step" for k in keys)
    flat = sum(".optimizer.distributed." in f".{k}" for k in keys)
    shared = roles["optimizer"] - per_param - flat
    parts = [(per_param, "per-parameter state"), (flat, "flat buffers"), (shared, "shared by all parameters")]
    assert "(" + ", ".join(f"{n} {what}" for n, what in parts if n) + ")" in note


def test_the_tie_and_the_pipeline_size_come_from_args():
    index = open_checkpoint(str(MCORE / "pp2_tied")).index
    assert index.metadata["parallel"] == {"tp": 1, "pp": 2, "ep": 1, "dp": 1}
    assert index.metadata["megatron_args"]["tied"] is True
    assert index.metadata["megatron_args"]["num_layers"] == 2


def test_optimizer_state_is_named_by_its_parameter():
    from ckptkit.convert.keys import split_roles

    index = open_checkpoint(str(MCORE / "tp2_swiglu_gqa")).index
    split = split_roles(index)
    assert set(split.model) == {k for k in index.tensors if not k.startswith("optimizer.")}
    for name in split.model:
        assert split.optim[f"state.{name}.exp_avg"] == f"optimizer.state.exp_avg.{name}"
        assert split.optim[f"state.{name}.exp_avg_sq"] == f"optimizer.state.exp_avg_sq.{name}"
    assert split.optim_objects["param_groups.0.lr"] == "optimizer.param_groups.0.lr"


def test_dp_reshardable_flat_buffers_are_named_as_such():
    run = CliRunner().invoke(cli, ["inspect", str(MCORE / "tp2dp2_distopt"), "--json"])
    assert run.exit_code == 0, run.output
    doc = json.loads(run.output)
    notes = doc["summary"]["notes"]
    assert any("flat buffers" in n and "dp_reshardable" in n for n in notes), notes
    flat = [t["key"] for t in doc["tensors"] if ".distributed." in t["key"]]
    assert flat and all(t["key"].startswith(("optimizer.", "chained_")) for t in doc["tensors"] if t["key"] in flat)


def test_fully_reshardable_optimizer_state_is_per_parameter():
    index = open_checkpoint(str(MCORE / "tp2dp2_distopt_full")).index
    assert not any(".distributed." in k for k in index.tensors)
    model = [k for k in index.tensors if not k.startswith("optimizer.")]
    assert all(f"optimizer.state.exp_avg.{k}" in index.tensors for k in model)


@pytest.mark.parametrize("name", DIST)
def test_verify_deep_and_diff_of_itself(name):
    runner = CliRunner()
    run = runner.invoke(cli, ["verify", "--deep", str(MCORE / name)])
    assert run.exit_code == 0, run.output
    run = runner.invoke(cli, ["diff", str(MCORE / name), str(MCORE / name)])
    assert run.exit_code == 0, run.output
    assert "\nequal\n" in run.output


def test_a_changed_tensor_is_a_difference(tmp_path):
    import shutil

    src = MCORE / "tp2_swiglu_gqa"
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    opened = open_checkpoint(str(copy))
    entry = opened.index.tensors["embedding.word_embeddings.weight"]
    loc = entry.pieces[0].location
    with open(copy / loc.file, "r+b") as f:
        f.seek(loc.offset)
        first = f.read(4)
        f.seek(loc.offset)
        f.write(bytes([first[0] ^ 1]) + first[1:])
    result = diff(str(src), str(copy))
    assert [r.name for r in result.rows if r.status == "different"] == ["embedding.word_embeddings.weight"]


def test_step_picks_an_iteration_of_the_save_root():
    runner = CliRunner()
    run = runner.invoke(cli, ["inspect", str(MCORE / "pp2_tied"), "--step", "2"])
    assert run.exit_code == 0, run.output
    assert "step        2" in run.output.splitlines()
    run = runner.invoke(cli, ["inspect", str(MCORE / "pp2_tied"), "--step", "3"])
    assert run.exit_code == 2
    assert "no iteration 3 in this Megatron save folder (iterations: iter_0000002)" in run.output
