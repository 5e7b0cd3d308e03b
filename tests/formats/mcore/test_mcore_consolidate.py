"""consolidate of a Megatron-Core torch_dist checkpoint writes one tensor per layer (and expert),
named `decoder.layers.<i>.X` as an MCore model's state_dict() names them, each equal bit for bit
to what MCore's own dist_checkpointing.load gave a TP1 PP1 model (the fixtures' truth files,
fixtures/make_mcore_fixtures.py). The truth model was built with the local layer spec, whose
state_dict names some tensors otherwise (`input_layernorm.weight` for the TE spec's
`self_attention.linear_qkv.layer_norm_weight`): each truth tensor records the checkpoint key and
layer it was loaded from, which give the per-layer name consolidate writes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from helpers import hostile
from ckptkit.formats.mcore.unstack import consolidated_model, layer_view
from ckptkit.formats.registry import open_checkpoint
from ckptkit.index.types import Box, Location, Piece, TensorEntry
from ckptkit.runner.fetch import Fetcher
from ckptkit.storage.source import LocalSource
from ckptkit_cli.main import cli
from conftest import DATA

MCORE = DATA / "mcore"
STACKED = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"


def _per_layer_name(key: str, layer: int | None) -> str:
    """The state_dict name of layer `layer` of the checkpoint's (stacked) key."""
    return key if layer is None else f"{STACKED}{layer}.{key[len(STACKED) :]}"


def _consolidated(name: str, tmp_path) -> dict[str, torch.Tensor]:
    out = tmp_path / "model.safetensors"
    run = CliRunner().invoke(cli, ["consolidate", str(MCORE / name), str(out)])
    assert run.exit_code == 0, run.output
    return load_file(out)


@pytest.mark.parametrize("name", ["tp2_swiglu_gqa", "pp2_tied", "tp2dp2_distopt"])
def test_every_tensor_is_one_layer_equal_to_mcores_own_load(name, tmp_path):
    truth = torch.load(MCORE / f"{name}.truth.pt", weights_only=True)
    expected = {_per_layer_name(*truth["where"][n]): t for n, t in truth["tensors"].items()}
    got = _consolidated(name, tmp_path)
    assert set(got) == set(expected)  # every layer, nothing stacked, nothing more (no _extra_state)
    for out_name, tensor in got.items():
        want = expected[out_name].contiguous()
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, out_name
        assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), out_name


def test_a_tied_output_layer_is_left_out_and_an_untied_one_kept():
    # MCore saves no output layer when it is tied (pp2_tied has none): one is added to its index
    # here, as a writer that kept it would, to see consolidate leave it out when args say it is tied
    for name, tied in (("pp2_tied", True), ("tp2_swiglu_gqa", False)):
        index = open_checkpoint(str(MCORE / name)).index
        assert index.metadata["megatron_args"]["tied"] is tied
        index.tensors.setdefault("output_layer.weight", dataclasses.replace(index.tensors[EMBEDDING]))
        model = {k: k for k in ("output_layer.weight", EMBEDDING)}
        names, _, notes = consolidated_model(index, model, include_optimizer=False)
        assert EMBEDDING in names and ("output_layer.weight" in names) is not tied
        assert any("not written: output_layer.weight (args say it is tied" in n for n in notes) is tied


def test_the_note_says_how_the_layers_were_named(tmp_path):
    run = CliRunner().invoke(cli, ["consolidate", str(MCORE / "pp2_tied"), str(tmp_path / "m.safetensors")])
    assert run.exit_code == 0, run.output
    assert "names: 12 stacked tensors (decoder.layers.X [L, ...]) written as 24 tensors, one per layer" in run.output
    assert "optimizer values (add --include-optimizer)" in run.output


# the plain optimizer keeps its step as a tensor (common_step), the distributed one in its groups (a value)
@pytest.mark.parametrize("name, step_tensors", [("tp2_swiglu_gqa", True), ("tp2dp2_distopt_full", False)])
def test_include_optimizer_writes_each_layers_state_equal_to_mcores_own_load(name, step_tensors, tmp_path):
    truth = torch.load(MCORE / f"{name}.optim_truth.pt", weights_only=True)
    out = tmp_path / "out"
    run = CliRunner().invoke(cli, ["consolidate", str(MCORE / name), str(out), "--include-optimizer"])
    assert run.exit_code == 0, run.output
    got = load_file(out / "optimizer.safetensors")
    expected = {
        f"state.{param}.{key}": value
        for param, states in truth["state"].items()
        for key, value in states.items()
        if key != "param" and (key != "step" or step_tensors)  # (the main copy is the model's own values)
    }
    assert set(got) == set(expected)
    for key, tensor in got.items():
        want = expected[key].contiguous()
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, key
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key
    model = load_file(out / "model.safetensors")
    assert set(model) == {p for p in truth["state"]}  # every trainable parameter, per layer


def test_include_optimizer_with_flat_buffers_is_refused_in_one_sentence(tmp_path):
    source, out = MCORE / "tp2dp2_distopt", tmp_path / "out"
    scene = hostile.Scene(source, out)
    run = hostile.run_ckptkit("consolidate", source, out, "--include-optimizer")
    hostile.check_refused(
        run, str(source), "dp_reshardable flat buffers", "consolidate without --include-optimizer", scene=scene
    )
    assert not out.exists()


def test_without_include_optimizer_flat_buffers_are_said_not_mappable(tmp_path):
    run = CliRunner().invoke(cli, ["consolidate", str(MCORE / "tp2dp2_distopt"), str(tmp_path / "m.safetensors")])
    assert run.exit_code == 0, run.output
    assert "(dp_reshardable flat buffers: not mappable to parameters)" in run.output


def _stacked(tmp_path, data: torch.Tensor, stride: tuple[int, ...] | None) -> tuple[TensorEntry, Fetcher]:
    """`data` [L, E, ...] written raw to a file as one piece (no MCore fixture has a piece holding
    several layers, or experts: this is how a view of one is read)."""
    raw = data if stride is None else data.transpose(-1, -2).contiguous()
    (tmp_path / "stacked.bin").write_bytes(raw.numpy().tobytes())
    if stride is not None:
        stride = raw.transpose(-1, -2).stride()
    loc = Location("stacked.bin", 0, raw.numel() * raw.element_size(), stride=stride)
    entry = TensorEntry("decoder.layers.mlp.experts.experts.linear_fc1.weight", "float32", tuple(data.shape))
    entry.pieces = [Piece(Box.whole(tuple(data.shape)), loc)]
    return entry, Fetcher(LocalSource(str(tmp_path)))


@pytest.mark.parametrize("stride", [None, "strided"])
def test_a_view_of_one_layer_and_expert_reads_that_slice(tmp_path, stride):
    data = torch.arange(3 * 2 * 4 * 5, dtype=torch.float32).reshape(3, 2, 4, 5)
    entry, fetcher = _stacked(tmp_path, data, stride)
    for i in range(3):
        for e in range(2):
            view = layer_view(entry, (i, e), f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight")
            assert view.shape == (4, 5)
            assert torch.equal(fetcher.fetch(view), data[i, e])
