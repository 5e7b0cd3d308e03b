"""Hostile ZeRO rank files against the flat-partition read path (flat_groups, SourceRuns' batch
path): a flat partition (fp32 masters or a partitioned optimizer state) stored as a view that is not
contiguous is refused in one sentence naming the rank file, by every command, and nothing is
written; read as contiguous bytes it would give the wrong elements, or bytes past its storage, in an
output that looks valid."""

from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptkit_cli.main import cli
from helpers.ds_fixtures import DS_DATA, ds_fixtures

NAME = "z2_fp32_w2"
pytestmark = pytest.mark.skipif(
    NAME not in ds_fixtures(), reason="no DeepSpeed fixtures (run fixtures/generate_deepspeed.py)"
)
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


def _refused(tmp_path, args: list[str], out) -> None:
    """The command refuses: not 0, one sentence naming rank 1's file and the strided view, no output."""
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and RANK1 in lines[0] and "strided view" in lines[0], res.output
    assert not out.exists(), res.output


def _consolidated(tmp_path, ckpt, view: torch.Tensor) -> None:
    """consolidate writes the values torch.load gives: embed.weight's last 142 elements are rank
    1's first 142 of group 0."""
    out = tmp_path / "st"
    res = CliRunner().invoke(cli, ["consolidate", str(ckpt), str(out)])
    assert res.exit_code == 0, res.output
    got = load_file(str(out / "model.safetensors"))["embed.weight"].flatten()
    assert torch.equal(got[-142:], view[:142].contiguous()), (got[-142:][:6], view[:6])


VIEWS = {
    "stride 2": lambda: (torch.arange(564, dtype=torch.float32) + 1000)[::2],  # every other element
    "expanded": lambda: torch.full((1,), 7.0).expand(282),
}  # one float seen 282 times
COMMANDS = {
    "consolidate": [],
    "consolidate --include-optimizer": ["--include-optimizer"],
    "reshard": ["--to", "3"],
    "convert": ["--to", "dcp"],
    "inspect": None,
    "verify": None,
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("kind", list(VIEWS))
def test_a_strided_master_partition_is_refused(tmp_path, kind, command):
    ckpt = _with_rank1_group0(tmp_path, VIEWS[kind]())
    out = tmp_path / "out"
    name, extra = command.split()[0], COMMANDS[command]
    if extra is None:  # read-only commands: refused the same (verify reports it as a problem)
        res = CliRunner().invoke(cli, [name, str(ckpt)])
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        assert RANK1 in res.output and "strided view" in res.output, res.output
        return
    _refused(tmp_path, [name, str(ckpt), str(out), *extra], out)


def test_storage_offset_master_partition_reads_its_own_elements(tmp_path):
    """A contiguous partition at a storage offset is not strided: it is read from that offset."""
    view = (torch.arange(564, dtype=torch.float32) + 1000)[100:382]
    _consolidated(tmp_path, _with_rank1_group0(tmp_path, view), view)


@pytest.mark.parametrize("include_optimizer", [True, False])
def test_a_strided_partitioned_exp_avg_is_refused(tmp_path, include_optimizer):
    """The optimizer state's flat partitions too, also where consolidate only counts them."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DS_DATA / NAME, ckpt)
    victim = ckpt / "global_step2" / RANK1
    state = torch.load(victim, weights_only=False)  # trusted: our own fixture
    state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"] = torch.arange(564.0)[::2]
    torch.save(state, victim)
    out = tmp_path / "o"
    _refused(
        tmp_path, ["consolidate", *(["--include-optimizer"] if include_optimizer else []), str(ckpt), str(out)], out
    )


def _with_rank1(tmp_path, name: str, change) -> tuple:
    """A copy of fixture `name` whose rank 1 optimizer_state_dict went through `change`."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DS_DATA / name, ckpt)
    victim = ckpt / "global_step2" / RANK1
    state = torch.load(victim, weights_only=False)  # trusted: our own fixture
    change(state["optimizer_state_dict"])
    torch.save(state, victim)
    return ckpt, tmp_path / "out"


@pytest.mark.parametrize("name,masters", [(NAME, GROUPS), ("z3_fp32_w2", "fp32_flat_groups")])
def test_a_flat_partition_of_no_described_group_is_refused(tmp_path, name, masters):
    """A rank holding one more flat partition than the groups the checkpoint describes: its data
    belongs to no parameter, so reading on would lose it (DeepSpeed's zero_to_fp32 refuses too)."""
    if name not in ds_fixtures():
        pytest.skip(f"needs the {name} fixture")
    ckpt, out = _with_rank1(tmp_path, name, lambda osd: osd[masters].append(torch.zeros(8)))
    for args in (["consolidate", str(ckpt), str(out)], ["reshard", str(ckpt), str(out), "--to", "3"]):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert RANK1 in res.output and "3 flat partitions" in res.output and "describes 2" in res.output, res.output
        assert not out.exists()


@pytest.mark.parametrize(
    "name,count",
    [
        (NAME, [0, 2]),
        (NAME, [2, 10**30]),
        (NAME, [3, 3]),
        (NAME, [2]),
        (NAME, [True, 2]),
        (NAME, [2.0, 2]),
        ("z3_fp32_w2", 3),
        ("z3_fp32_w2", 0),
        ("z3_fp32_w2", "2"),
    ],
)
def test_a_partition_count_other_than_the_ranks_is_refused(tmp_path, name, count):
    """partition_count says how many ranks each group is partitioned over; one that is not the
    number of optim-states files describes another layout (or a lie): refused, nothing written."""
    if name not in ds_fixtures():
        pytest.skip(f"needs the {name} fixture")
    ckpt, out = _with_rank1(tmp_path, name, lambda osd: osd.__setitem__("partition_count", count))
    res = CliRunner().invoke(cli, ["consolidate", str(ckpt), str(out)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and RANK1 in lines[0] and "partition_count" in lines[0], res.output
    assert not out.exists()
