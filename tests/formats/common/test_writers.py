"""Writers produce files the frameworks themselves read back exactly."""

from __future__ import annotations

import pytest
import torch

from ckptkit.context import RunContext
from ckptkit.formats.dcp.writer import write_dcp
from ckptkit.formats.registry import open_checkpoint
from ckptkit.formats.torch_save.writer import write_torch_save
from ckptkit.index.layouts import fsdp2_layout
from ckptkit.runner.fetch import Fetcher
from ckptkit.storage.output import open_output
from conftest import DATA, assert_tensor_equal, load_truth


def test_torch_save_writer_is_read_by_torch_load(tmp_path):
    opened = open_checkpoint(str(DATA / "plain_state_dict.pt"))
    with open_output(str(tmp_path / "out")) as out:
        write_torch_save(out, "model.pt", opened.index, Fetcher(opened.source), ctx=RunContext(fixed_slab=64))
    truth = torch.load(DATA / "plain_state_dict.pt", weights_only=True)
    ours = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert set(ours) == set(truth)
    for key, expected in truth.items():
        assert_tensor_equal(ours[key], expected, key)
    # tied weights stay tied: one storage
    assert ours["embed.weight"].untyped_storage().data_ptr() == ours["lm_head.weight"].untyped_storage().data_ptr()
    ours_mmap = torch.load(tmp_path / "out" / "model.pt", weights_only=True, mmap=True)
    assert torch.equal(ours_mmap["extra_bf16"], truth["extra_bf16"])


def test_torch_save_writer_keeps_nesting_and_values(tmp_path):
    truth = load_truth("fsdp2_w2")
    opened = open_checkpoint(str(DATA / "fsdp2_w2"))
    with open_output(str(tmp_path / "out")) as out:
        write_torch_save(out, "full.pt", opened.index, Fetcher(opened.source), ctx=RunContext(fixed_slab=1 << 20))
    full = torch.load(tmp_path / "out" / "full.pt", weights_only=True)
    assert full["optim"]["param_groups"][1]["weight_decay"] == 0.0
    assert_tensor_equal(full["model"]["embed.weight"], truth["model.embed.weight"], "embed")
    assert_tensor_equal(full["optim"]["state"]["gate"]["exp_avg"], truth["optim.state.gate.exp_avg"], "gate")


@pytest.mark.parametrize("slab", [8, 1 << 20])
def test_dcp_writer_is_read_by_torch_dcp(tmp_path, slab):
    """torch's own single-process DCP loader reads our output (slabs split large chunks)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    truth = load_truth("fsdp2_w3")
    opened = open_checkpoint(str(DATA / "fsdp2_w3"))
    with open_output(str(tmp_path / "out")) as out:
        write_dcp(
            out,
            opened.index,
            Fetcher(opened.source),
            fsdp2_layout(opened.index, 2),
            ctx=RunContext(fixed_slab=slab),
            source=opened.source,
        )
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "full.pt"))
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(torch.load(tmp_path / "full.pt", weights_only=False))
    assert set(flat) == set(truth)
    for key, expected in truth.items():
        if isinstance(expected, torch.Tensor):
            assert_tensor_equal(flat[key], expected, key)
        else:
            assert flat[key] == expected, key


def test_dcp_writer_stores_replicated_tensors_once(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ckptkit.index.types import Box
    from ckptkit.index.layouts import Assignment, Layout

    truth = load_truth("fsdp2_w2")
    opened = open_checkpoint(str(DATA / "fsdp2_w2"))
    replicated = Layout(
        3,
        {
            k: [Assignment(r, Box.whole(t.shape)) for r in range(3)]  # DDP: every rank, whole
            for k, t in opened.index.tensors.items()
        },
    )
    with open_output(str(tmp_path / "out")) as out:
        write_dcp(
            out,
            opened.index,
            Fetcher(opened.source),
            replicated,
            ctx=RunContext(fixed_slab=1 << 20),
            source=opened.source,
        )
    again = open_checkpoint(str(tmp_path / "out")).index
    assert all(len(t.pieces) == 1 for t in again.tensors.values())
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "full.pt"))
    flat, _ = flatten_state_dict(torch.load(tmp_path / "full.pt", weights_only=False))
    for key, expected in truth.items():
        if isinstance(expected, torch.Tensor):
            assert_tensor_equal(flat[key], expected, key)
