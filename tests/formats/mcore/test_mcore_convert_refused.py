"""convert from a Megatron-Core checkpoint is refused in one sentence, nothing written: MCore's param
groups do not list their parameters, so its model tensors would be filed as frozen parameters and
their optimizer state left without an owner. consolidate, which needs no roles, still reads it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from helpers import hostile
from ckptkit_cli.main import cli
from conftest import DATA

MCORE = DATA / "mcore"
SENTENCE = "converting a Megatron-Core checkpoint is not supported yet"


def test_convert_to_dcp_is_refused_in_one_sentence_and_writes_nothing(tmp_path):
    source, out = MCORE / "tp2_swiglu_gqa", tmp_path / "out"
    scene = hostile.Scene(source, out)
    run = hostile.run_ckptkit("convert", source, out, "--to", "dcp")
    hostile.check_refused(run, str(source), SENTENCE, "param groups", "consolidate", scene=scene)
    assert not out.exists()


@pytest.mark.parametrize("to", ["torch", "safetensors", "fsdp2", "zero2"])
@pytest.mark.parametrize("where", ["pp2_tied", "tp2dp2_distopt_full/iter_0000002"])
def test_every_target_is_refused_from_a_save_root_and_an_iteration_folder(tmp_path, to, where):
    out = tmp_path / "out"
    ranks = ["--world-size", "1"] if to in ("fsdp2", "zero2") else []
    run = CliRunner().invoke(cli, ["convert", str(MCORE / where), str(out), "--to", to, *ranks])
    assert run.exit_code == 2, run.output
    assert SENTENCE in run.output
    assert not out.exists()


def test_consolidate_still_writes_the_model(tmp_path):
    out = tmp_path / "model.safetensors"
    run = CliRunner().invoke(cli, ["consolidate", str(MCORE / "tp2_swiglu_gqa"), str(out)])
    assert run.exit_code == 0, run.output
    assert out.stat().st_size > 0
