"""A legacy Megatron-LM iteration folder (`mp_rank_TT[_PPP]/model_optim_rng.pt`) is read as one
checkpoint: tensor-parallel parts joined by Megatron's split rules (column-parallel on dim 0,
GQA's grouped linear_qkv included, row-parallel on dim 1, SwiGLU's [gate_r; up_r] halves placed
as [gate_all; up_all]) and pipeline stages placed by their layer offsets.

Truth: legacy_tp2 and legacy_pp2 are trained exactly as tp2_swiglu_gqa and pp2_tied are (same
seeds, data and layout; fixtures/make_mcore_fixtures.py), so MCore's own dist_checkpointing.load of
those at TP1 PP1 (`<name>.truth.pt`, named as the local layer spec's state_dict, as the legacy
files are) is the whole model the ranks' parts must make. The rank files' own tensors are checked
to be those parts."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from helpers import hostile
from ckptkit.formats.registry import open_checkpoint
from ckptkit_cli.main import cli
from conftest import DATA

MCORE = DATA / "mcore"
TRUTH_OF = {"legacy_tp2": "tp2_swiglu_gqa", "legacy_pp2": "pp2_tied"}


def _truth(name: str) -> dict[str, torch.Tensor]:
    tensors = torch.load(MCORE / f"{TRUTH_OF[name]}.truth.pt", weights_only=True)["tensors"]
    return {k[len("model.") :]: t for k, t in tensors.items()}


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)), what


@pytest.mark.parametrize("name", ["legacy_tp2", "legacy_pp2"])
@pytest.mark.parametrize("where", ["", "iter_0000002"], ids=["save root", "iteration folder"])
def test_consolidate_joins_the_ranks_into_mcores_own_tp1_model(name, where, tmp_path):
    out = tmp_path / "model.safetensors"
    run = CliRunner().invoke(cli, ["consolidate", str(MCORE / name / where), str(out)])
    assert run.exit_code == 0, run.output
    got, truth = load_file(out), _truth(name)
    assert set(got) == set(truth)  # every layer of every stage; a tied output layer not kept twice
    for key, tensor in got.items():
        _same(tensor, truth[key], key)


def test_the_rank_files_hold_the_parts_of_the_truth():
    """The join is not an identity: each rank holds half of the split tensors."""
    truth = _truth("legacy_tp2")
    ranks = [torch.load(MCORE / f"legacy_tp2.rank{r}.truth.pt", weights_only=True) for r in (0, 1)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    _same(torch.cat([ranks[0][qkv], ranks[1][qkv]]), truth[qkv], qkv)
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    (g0, u0), (g1, u1) = ranks[0][fc1].chunk(2), ranks[1][fc1].chunk(2)
    _same(torch.cat([g0, g1, u0, u1]), truth[fc1], fc1)
    assert not torch.equal(torch.cat([ranks[0][fc1], ranks[1][fc1]]), truth[fc1])  # (plain concat is wrong)
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    _same(torch.cat([ranks[0][proj], ranks[1][proj]], 1), truth[proj], proj)


def test_pipeline_stages_are_placed_by_their_layer_offsets():
    index = open_checkpoint(str(MCORE / "legacy_pp2")).index
    layers = sorted({int(k.split(".")[2]) for k in index.tensors if k.startswith("decoder.layers.")})
    assert layers == [0, 1]  # stage 1's layer 0 is the model's layer 1
    stage1 = {p.location.file for p in index.tensors["decoder.layers.1.mlp.linear_fc1.weight"].pieces}
    assert stage1 == {"iter_0000002/mp_rank_00_001/model_optim_rng.pt"}
    assert "output_layer.weight" not in index.tensors  # the last stage's copy of the tied embedding
    assert index.step == 2 and index.metadata["parallel"]["pp"] == 2


def test_inspect_says_what_was_joined_and_that_the_optimizer_is_not_read():
    run = CliRunner().invoke(cli, ["inspect", str(MCORE / "legacy_tp2")])
    assert run.exit_code == 0, run.output
    assert "2 rank files (tp 2 x pp 1) joined into 28 model tensors" in run.output
    assert "optimizer state of a legacy Megatron-LM checkpoint" in run.output


def test_convert_of_the_model_alone_goes_through_and_the_optimizer_is_refused(tmp_path):
    ok = CliRunner().invoke(
        cli,
        ["convert", str(MCORE / "legacy_tp2"), str(tmp_path / "m.safetensors"), "--to", "safetensors", "--model-only"],
    )
    assert ok.exit_code == 0, ok.output
    got, truth = load_file(tmp_path / "m.safetensors"), _truth("legacy_tp2")
    assert set(got) == set(truth) and all(torch.equal(got[k], truth[k]) for k in got)
    source, out = MCORE / "legacy_tp2", tmp_path / "dcp"
    scene = hostile.Scene(source, out)
    run = hostile.run_ckptkit("convert", source, out, "--to", "dcp")
    hostile.check_refused(run, str(source), "keyed by parameter number on each rank", "--model-only", scene=scene)
    assert not out.exists()


def test_a_missing_rank_is_refused_in_one_sentence(tmp_path):
    import shutil

    copy = tmp_path / "legacy"
    shutil.copytree(MCORE / "legacy_tp2", copy)
    shutil.rmtree(copy / "iter_0000002" / "mp_rank_01")
    scene = hostile.Scene(copy, None)
    run = hostile.run_ckptkit("inspect", copy)
    hostile.check_refused(run, str(copy), "tensor_model_parallel_size=2", "missing", scene=scene)
