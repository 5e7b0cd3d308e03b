"""A careless user and an attacker against writes: write errors other than a full disk, and
--overwrite of what no conversion means to replace (the contract: tests/helpers/cli_contract.py).
"""

from __future__ import annotations

import os

import pytest

from helpers.cli_contract import DCP, one_sentence as _one_sentence, run_ckptkit as _ckptkit


# ---- write errors other than a full disk ---------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["consolidate", DCP, "out"],
        ["convert", "--to", "torch", DCP, "out.pt"],
        ["reshard", "--to", "3", DCP, "out"],
        ["reshard", "--to", "3", "--nproc", "2", DCP, "out"],
    ],
)
def test_an_output_that_cannot_be_written_is_one_sentence_and_leaves_nothing(tmp_path, command):
    work = tmp_path / "work"
    work.mkdir()
    res = _ckptkit(*command, cwd=str(work), fsize=3 * 1024)
    assert list(work.iterdir()) == []  # holds today: the temporary is removed
    _one_sentence(res)


# ---- the in-job API ------------------------------------------------------------------------------


# ---- --overwrite of what no conversion means to replace ------------------------------------------


@pytest.mark.parametrize("out", [".", "..", "home"])
def test_overwrite_refuses_a_folder_holding_the_current_or_home_folder(tmp_path, out):
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    target = str(home) if out == "home" else out
    res = _ckptkit(
        "consolidate",
        "--overwrite",
        DCP,
        target,
        cwd=str(work) if out != "home" else str(tmp_path),
        env={"HOME": str(home)},
    )
    _one_sentence(res)
    assert "--overwrite would delete it" in res.stderr
    assert (work / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "command,name",
    [(["consolidate"], "out"), (["convert", "--to", "torch"], "out.pt")],
    ids=["folder output", "file output"],
)
def test_overwrite_refuses_a_fifo(tmp_path, command, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    res = _ckptkit(*command, "--overwrite", DCP, fifo)
    _one_sentence(res)
    assert "device, FIFO or socket" in res.stderr
    assert os.path.exists(fifo) and not os.path.isdir(fifo) and not os.path.isfile(fifo)


def test_overwrite_still_replaces_an_ordinary_output_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    res = _ckptkit("consolidate", "--overwrite", DCP, out, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
