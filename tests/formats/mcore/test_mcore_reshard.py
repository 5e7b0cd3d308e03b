"""reshard --to tp=T,pp=P[,dp=D] of a Megatron-Core checkpoint (fixtures written by megatron-core
itself): every tensor of the output equal to the source's as torch's own DCP reader loads both,
chunked exactly as MCore's save chunked the fixtures at their layout, common.pt's args rewritten
(read by torch.load as MCore reads it, and by ckptkit's restricted loader), and the refusals one
sentence with nothing written. That MCore loads the output into a model and optimizer at the new
layout is test_mcore_loads_reshard.py (a real MCore job)."""

from __future__ import annotations

import argparse

import pytest
import torch
from click.testing import CliRunner

from ckptkit.formats.registry import open_checkpoint
from ckptkit.runner.fetch import Fetcher
from ckptkit_cli.main import cli
from conftest import DATA
from helpers import hostile
from helpers.mcore_dcp import chunks_by_rank, global_tensors

MCORE = DATA / "mcore"
ITER = "iter_0000002"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _reshard(source, out, to, *extra):
    run = CliRunner().invoke(cli, ["reshard", str(source), str(out), "--to", to, *extra])
    assert run.exit_code == 0, run.output
    return run.output


@pytest.mark.parametrize(
    ("name", "to"),
    [
        ("tp2_swiglu_gqa", "tp=1,pp=1"),
        ("tp2_swiglu_gqa", "tp=1,pp=2"),
        ("pp2_tied", "tp=2,pp=1"),
        ("tp2dp2_distopt_full", "tp=1,pp=2"),
    ],
)
def test_every_tensor_equals_the_sources_as_torch_loads_both(tmp_path, name, to):
    out = tmp_path / "out"
    _reshard(MCORE / name, out, to)
    expected = global_tensors(MCORE / name / ITER)
    got = global_tensors(out / ITER)
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    opened = open_checkpoint(str(out))  # ckptkit reads its own output back, equal too
    fetcher = Fetcher(opened.source, index=opened.index)
    for key, tensor in expected.items():
        assert torch.equal(fetcher.fetch(opened.index.tensors[key]), tensor), key


@pytest.mark.parametrize(
    ("name", "to"),
    [("tp2_swiglu_gqa", "tp=2,pp=1"), ("pp2_tied", "tp=1,pp=2"), ("tp2dp2_distopt_full", "tp=2,pp=1,dp=2")],
)
def test_at_the_sources_layout_each_chunk_is_where_mcores_save_put_it(tmp_path, name, to):
    out = tmp_path / "out"
    _reshard(MCORE / name, out, to)
    assert chunks_by_rank(out / ITER) == chunks_by_rank(MCORE / name / ITER)


def test_swiglu_fc1_is_split_by_chunk_offsets_two_chunks_per_tp_rank(tmp_path):
    out = tmp_path / "out"
    _reshard(MCORE / "pp2_tied", out, "tp=2,pp=1")  # (pp2_tied is not gated: fc1 in one chunk per rank)
    plain = chunks_by_rank(out / ITER)["decoder.layers.mlp.linear_fc1.weight"]
    assert sorted(plain) == [(0, (0, 0, 0), (1, 16, 16)), (0, (1, 0, 0), (1, 16, 16)),
                             (1, (0, 16, 0), (1, 16, 16)), (1, (1, 16, 0), (1, 16, 16))]  # fmt: skip
    _reshard(MCORE / "tp2_swiglu_gqa", tmp_path / "tp1", "tp=1,pp=2")
    gated = chunks_by_rank(tmp_path / "tp1" / ITER)["decoder.layers.mlp.linear_fc1.weight"]
    assert sorted(gated) == [(0, (0, 0, 0), (1, 32, 16)), (0, (0, 32, 0), (1, 32, 16)),
                             (1, (1, 0, 0), (1, 32, 16)), (1, (1, 32, 0), (1, 32, 16))]  # fmt: skip


def test_a_pipeline_stage_keeps_the_global_layer_index_and_its_modules(tmp_path):
    out = tmp_path / "out"
    _reshard(MCORE / "tp2_swiglu_gqa", out, "tp=1,pp=2")
    chunks = chunks_by_rank(out / ITER)
    assert chunks["decoder.layers.self_attention.linear_proj.weight"] == {
        (0, (0, 0, 0), (1, 16, 16)),
        (1, (1, 0, 0), (1, 16, 16)),
    }
    assert {r for r, _, _ in chunks["embedding.word_embeddings.weight"]} == {0}
    assert {r for r, _, _ in chunks["output_layer.weight"]} == {1}
    assert {r for r, _, _ in chunks["decoder.final_layernorm.weight"]} == {1}


def test_common_pt_args_say_the_new_layout_to_torch_load_and_to_ckptkit(tmp_path):
    out = tmp_path / "out"
    _reshard(MCORE / "tp2_swiglu_gqa", out, "tp=1,pp=2")
    with torch.serialization.safe_globals([argparse.Namespace]):  # what MCore registers before it loads
        common = torch.load(out / ITER / "common.pt", map_location="cpu")
    source = torch.load(MCORE / "tp2_swiglu_gqa" / ITER / "common.pt", map_location="cpu", weights_only=False)
    args = vars(common["args"])
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (1, 2)
    assert (args["data_parallel_size"], args["world_size"]) == (1, 2)
    changed = {k for k in args if args[k] != vars(source["args"])[k]}
    assert changed == {"tensor_model_parallel_size", "pipeline_model_parallel_size"}
    assert common["iteration"] == source["iteration"] == 2
    assert common["optimizer"]["param_groups"] == source["optimizer"]["param_groups"]
    index = open_checkpoint(str(out)).index
    assert index.metadata["parallel"] == {"tp": 1, "pp": 2, "ep": 1, "dp": 1}
    assert index.step == 2
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (out / ITER / "metadata.json").read_bytes() == (
        MCORE / "tp2_swiglu_gqa" / ITER / "metadata.json"
    ).read_bytes()


def test_an_iteration_folder_is_written_as_an_iteration_folder(tmp_path):
    out = tmp_path / "out"
    _reshard(MCORE / "pp2_tied" / ITER, out, "tp=2,pp=1")
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt",
                                                     "metadata.json"]  # fmt: skip
    assert open_checkpoint(str(out)).index.metadata["parallel"]["tp"] == 2


def test_rng_states_of_the_old_layout_are_left_out_and_said(tmp_path):
    out = tmp_path / "out"
    said = _reshard(MCORE / "tp2_swiglu_gqa", out, "tp=1,pp=1")
    assert "not written: 2 per-rank RNG states" in said and "--no-load-rng" in said
    assert not any(k.startswith("rng_state") for k in open_checkpoint(str(out)).index.objects)
    _reshard(MCORE / "tp2dp2_distopt_full", tmp_path / "same", "tp=2,pp=1,dp=1")  # same tp and pp: kept
    kept = open_checkpoint(str(tmp_path / "same")).index.objects
    assert sorted(k for k in kept if k.startswith("rng_state")) == [
        "rng_state/shard_0.0_1.2",
        "rng_state/shard_0.1_1.2",
    ]


def test_a_dp_reshardable_optimizer_asked_to_follow_tp_is_refused(tmp_path):
    source, out = MCORE / "tp2dp2_distopt", tmp_path / "out"
    scene = hostile.Scene(source, out)
    run = hostile.run_ckptkit("reshard", source, out, "--to", "tp=1,pp=1")
    hostile.check_refused(
        run, str(source), "dp_reshardable", "--dist-ckpt-optim-fully-reshardable", "--model-only", scene=scene
    )


def test_model_only_writes_the_model_of_a_dp_reshardable_checkpoint(tmp_path):
    out = tmp_path / "out"
    _reshard(MCORE / "tp2dp2_distopt", out, "tp=1,pp=1", "--model-only")
    index = open_checkpoint(str(out)).index
    assert index.tensors and all(k.split(".")[0] != "optimizer" for k in index.tensors)
    common = torch.load(out / ITER / "common.pt", map_location="cpu", weights_only=False)
    assert "optimizer" not in common
    expected = global_tensors(MCORE / "tp2dp2_distopt" / ITER)
    got = global_tensors(out / ITER)
    assert set(got) == {k for k in expected if not k.startswith("optimizer.")}
    assert all(torch.equal(got[k], expected[k]) for k in got)


@pytest.mark.parametrize(
    ("to", "words"),
    [
        ("3", ("tensor, pipeline and data parallel sizes", "--to tp=T,pp=P")),
        ("tp=1,pp=3", ("2 decoder layers do not split evenly over pp=3",)),
        ("tp=3,pp=1", ("tp=3 does not split evenly",)),
        ("tp=1,pp=1,ep=2", ("ep=2 does not divide dp=1",)),
    ],
)
def test_a_layout_mcore_cannot_have_is_refused(tmp_path, to, words):
    source, out = MCORE / "tp2_swiglu_gqa", tmp_path / "out"
    scene = hostile.Scene(source, out)
    run = hostile.run_ckptkit("reshard", source, out, "--to", to)
    hostile.check_refused(run, str(source), *words, scene=scene)
