"""convert --to dcp from a weights-only source (a safetensors file, a plain state dict) lays the
output out like FSDP2 at --world-size: every floating N-d tensor, which nothing marks as a buffer,
is a parameter cut on dim 0 with torch.chunk, so every rank's file holds its own rows; what cannot
be a parameter (an integer tensor, a 0-d value) stays whole. Read back with torch's own DCP reader;
a real FSDP2 job at 2 and 3 ranks loads it in test_fsdp2_loads_converted_folders.py."""

from __future__ import annotations


import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckptkit_cli.main import cli


def _convert(*args) -> str:
    res = CliRunner().invoke(cli, ["convert", *map(str, args)])
    assert res.exit_code == 0, res.output
    return res.output


def _chunks(folder) -> dict[str, list[tuple[tuple, tuple]]]:
    """key -> [(offsets, sizes)] of every chunk DCP's own metadata records."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {k: [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks] for k, m in meta.items() if hasattr(m, "chunks")}


def _torch_chunk(shape: tuple, world: int) -> list[tuple[tuple, tuple]]:
    """FSDP2's Shard(0): torch.chunk's rows, empty chunks left out."""
    rows = torch.arange(shape[0]).chunk(world)
    return [((int(r[0]),) + (0,) * (len(shape) - 1), (len(r),) + tuple(shape[1:])) for r in rows if len(r)]


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    """A safetensors file as safetensors itself writes it: parameters, an int counter, a 0-d value."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("w") / "model.safetensors"
    save_file(
        {
            "embed.weight": torch.randn(10, 4),
            "block.weight": torch.randn(5, 4),
            "block.bias": torch.randn(5),
            "norm.num_batches_tracked": torch.tensor(7),
            "scale": torch.tensor(0.5),
            "tiny.weight": torch.randn(1, 3),
        },
        str(path),
    )
    return path


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_are_cut_like_fsdp2(weights_file, tmp_path, world):
    out = _convert(weights_file, tmp_path / "d", "--to", "dcp", "--world-size", world)
    assert "4 frozen, 2 buffers" in out  # 4 parameters no optimizer trains; an int and a 0-d value
    chunks = _chunks(tmp_path / "d")
    for name, shape in {
        "embed.weight": (10, 4),
        "block.weight": (5, 4),
        "block.bias": (5,),
        "tiny.weight": (1, 3),
    }.items():
        assert chunks[f"model.{name}"] == _torch_chunk(shape, world), name
    assert chunks["model.norm.num_batches_tracked"] == [((), ())]
    assert chunks["model.scale"] == [((), ())]
    for rank in range(world):
        assert (tmp_path / "d" / f"__{rank}_0.distcp").stat().st_size > 0, f"rank {rank}'s file is empty"


def test_values_read_back_with_torch(weights_file, tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _convert(weights_file, tmp_path / "d", "--to", "dcp", "--world-size", "3")
    dcp_to_torch_save(str(tmp_path / "d"), str(tmp_path / "back.pt"))
    back = torch.load(tmp_path / "back.pt", weights_only=True)["model"]
    truth = load_file(str(weights_file))
    assert sorted(back) == sorted(truth)
    for name, value in truth.items():
        assert torch.equal(back[name], value), name


def test_frozen_glob_gives_the_same_layout(weights_file, tmp_path):
    _convert(weights_file, tmp_path / "default", "--to", "dcp", "--world-size", "2")
    _convert(
        weights_file,
        tmp_path / "glob",
        "--to",
        "dcp",
        "--world-size",
        "2",
        "--frozen",
        "*.weight",
        "--frozen",
        "*.bias",
    )
    assert _chunks(tmp_path / "default") == _chunks(tmp_path / "glob")


def test_a_sharded_source_still_tells_buffers_apart(tmp_path):
    """A DCP saved by FSDP2 at 2 ranks knows its buffers (whole on every rank): kept whole."""
    from conftest import DATA

    out = _convert(DATA / "fsdp2_w2", tmp_path / "d", "--to", "dcp", "--world-size", "3", "--model-only")
    assert "3 buffers" in out
