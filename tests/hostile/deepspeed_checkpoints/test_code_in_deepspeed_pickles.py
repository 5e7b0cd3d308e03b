"""Hostile DeepSpeed files: a pickle that would run code is refused, nothing executes."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from ckptkit_cli.main import cli
from helpers.ds_fixtures import DS_DATA, ds_fixtures

FIXTURES = ds_fixtures()
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures (run fixtures/generate_deepspeed.py)")


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("which", ["optim", "model"])
@pytest.mark.parametrize("name", [n for n in ("z1_fp16_w2", "z3_bf16_w2") if n in FIXTURES])
def test_code_in_deepspeed_files_is_refused(tmp_path, name, which):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DS_DATA / name, ckpt)
    marker = tmp_path / "MARKER"
    tag = ckpt / "global_step2"
    pattern = "*optim_states.pt" if which == "optim" else "*model_states.pt"
    victim = sorted(tag.glob(pattern))[0]
    original = torch.load(victim, weights_only=False)  # trusted: our own fixture
    original["ds_version"] = Evil(str(marker))
    torch.save(original, victim)
    runner = CliRunner()
    for args in (
        ["inspect", str(ckpt)],
        ["verify", "--deep", str(ckpt)],
        ["consolidate", str(ckpt), str(tmp_path / "st")],
        ["reshard", str(ckpt), str(tmp_path / "r"), "--to", "3"],
        ["convert", str(ckpt), str(tmp_path / "c"), "--to", "dcp"],
    ):
        res = runner.invoke(cli, args)
        assert res.exit_code != 0, args
        assert victim.name in res.output and ("posix.system" in res.output or "os.system" in res.output), res.output
        assert "Traceback" not in res.output
        assert not marker.exists()
    assert not (tmp_path / "st").exists() and not (tmp_path / "r").exists() and not (tmp_path / "c").exists()
