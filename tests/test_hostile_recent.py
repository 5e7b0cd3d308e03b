"""Hostile ZeRO rank files against the recent ZeRO read/write path (flat_groups, SourceRuns'
batch path): a master partition stored as a view that is not plain contiguous must be read
with its strides or refused, never read as contiguous bytes (wrong values, or bytes past its
storage) into an output that looks valid."""
from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptkit_cli.main import cli
from ds_helpers import DS_DATA, ds_fixtures

NAME = "z2_fp32_w2"
pytestmark = pytest.mark.skipif(NAME not in ds_fixtures(), reason="no DeepSpeed fixtures (run fixtures/generate_deepspeed.py)")
RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
GROUPS = "single_partition_of_fp32_groups"


def _with_rank1_group0(tmp_path, view: torch.Tensor):
    """A copy of the ZeRO-2 fixture whose rank 1 stores its group-0 fp32 partition as `view`."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DS_DATA / NAME, ckpt)
    victim = ckpt / "global_step2" / RANK1
    state = torch.load(victim, weights_only=False)  # trusted: our own fixture
    assert state["optimizer_state_dict"][GROUPS][0].numel() == view.numel() == 282
    state["optimizer_state_dict"][GROUPS][0] = view
    torch.save(state, victim)
    return ckpt


def _consolidated_or_refused(tmp_path, ckpt, view: torch.Tensor) -> None:
    """consolidate either refuses (exit != 0, one sentence, no output) or writes the values
    torch.load gives: embed.weight's last 142 elements are rank 1's first 142 of group 0."""
    out = tmp_path / "st"
    res = CliRunner().invoke(cli, ["consolidate", str(ckpt), str(out)])
    assert "Traceback" not in res.output
    if res.exit_code != 0:
        assert RANK1 in res.output, res.output
        assert not out.exists()
        return
    got = load_file(str(out / "model.safetensors"))["embed.weight"].flatten()
    assert torch.equal(got[-142:], view[:142].contiguous()), (got[-142:][:6], view[:6])


@pytest.mark.xfail(strict=True, reason="flat_groups._FlatPieces.add drops the master partition's "
                   "Location.stride (unchecked_location(file, offset, length)): a strided fp32 partition "
                   "is read as contiguous bytes, consolidate exits 0 with the wrong values")
def test_strided_master_partition_is_read_with_its_strides_or_refused(tmp_path):
    view = (torch.arange(564, dtype=torch.float32) + 1000)[::2]  # stride 2 over a 564-element storage
    _consolidated_or_refused(tmp_path, _with_rank1_group0(tmp_path, view), view)


@pytest.mark.xfail(strict=True, reason="flat_groups._FlatPieces.add drops the stride of an expanded "
                   "(stride-0) fp32 partition: 282*4 bytes are read from a 4-byte storage, i.e. past it "
                   "(other members' bytes / zip headers), into a consolidated file that exits 0")
def test_expanded_master_partition_never_reads_past_its_storage(tmp_path):
    view = torch.full((1,), 7.0).expand(282)  # one stored float seen 282 times
    _consolidated_or_refused(tmp_path, _with_rank1_group0(tmp_path, view), view)


def test_storage_offset_master_partition_reads_its_own_elements(tmp_path):
    """Holds: a contiguous partition at a storage offset reads from that offset."""
    view = (torch.arange(564, dtype=torch.float32) + 1000)[100:382]
    _consolidated_or_refused(tmp_path, _with_rank1_group0(tmp_path, view), view)


@pytest.mark.xfail(strict=True, reason="the same dropped stride on reshard's road (flat_groups -> "
                   "SourceRuns/table_ranges copy the bytes as contiguous): reshard exits 0 and its ranks "
                   "hold the wrong values")
def test_reshard_of_a_strided_master_partition_keeps_its_values_or_refuses(tmp_path):
    view = (torch.arange(564, dtype=torch.float32) + 1000)[::2]
    ckpt = _with_rank1_group0(tmp_path, view)
    out = tmp_path / "r"
    res = CliRunner().invoke(cli, ["reshard", str(ckpt), str(out), "--to", "3"])
    assert "Traceback" not in res.output
    if res.exit_code != 0:
        assert RANK1 in res.output and not out.exists(), res.output
        return
    _consolidated_or_refused(tmp_path, out, view)


@pytest.mark.xfail(strict=True, reason="group_state's partitioned optimizer state (exp_avg) goes through "
                   "_FlatPieces.add too: a strided exp_avg is written by consolidate --include-optimizer "
                   "as contiguous bytes (0, 1, 2, ... for 0, 2, 4, ...)")
def test_strided_partitioned_exp_avg_is_read_with_its_strides_or_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DS_DATA / NAME, ckpt)
    victim = ckpt / "global_step2" / RANK1
    state = torch.load(victim, weights_only=False)  # trusted: our own fixture
    view = torch.arange(564, dtype=torch.float32)[::2]
    state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"] = view
    torch.save(state, victim)
    out = tmp_path / "o"
    res = CliRunner().invoke(cli, ["consolidate", "--include-optimizer", str(ckpt), str(out)])
    assert "Traceback" not in res.output
    if res.exit_code != 0:
        assert RANK1 in res.output and not out.exists(), res.output
        return
    got = load_file(str(out / "optimizer.safetensors"))["state.embed.weight.exp_avg"].flatten()
    assert torch.equal(got[-142:], view[:142].contiguous()), (got[-142:][:6], view[:6])
