"""One RunContext per command: the CLI builds it once, and the very same object reaches the writers
(a reshard's read-ahead wraps only its progress), with the budget and workers the flags (or the
environment) chose; every buffer is a share of it."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import cli.main as cli_main
from cli.context import Context as CliContext
from ckptkit import knobs
from ckptkit.context import RunContext
from ckptkit.ops.options import RunOptions
from conftest import DATA

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def made(monkeypatch):
    """Every RunContext the CLI builds, in order."""
    contexts: list[RunContext] = []
    build = CliContext.make_run_context

    def recording(ctx, flags):
        contexts.append(build(ctx, flags))
        return contexts[-1]

    monkeypatch.setattr(CliContext, "make_run_context", recording)
    return contexts


def _writer_spy(monkeypatch, module, name: str) -> list[RunContext]:
    seen: list[RunContext] = []
    real = getattr(module, name)

    def spy(*args, ctx, **kwargs):
        seen.append(ctx)
        return real(*args, ctx=ctx, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_reshard_builds_one_context_and_hands_it_to_the_writer(tmp_path, made, monkeypatch):
    from ckptkit.formats.dcp import format as dcp_format

    seen = _writer_spy(monkeypatch, dcp_format, "write_dcp")
    res = CliRunner().invoke(
        cli_main.cli,
        [
            "--quiet",
            "reshard",
            str(DATA / "fsdp2_w2"),
            str(tmp_path / "o"),
            "--to",
            "3",
            "--memory-budget",
            "64MiB",
            "--workers",
            "3",
            "--overwrite",
        ],
    )
    assert res.exit_code == 0, res.output
    assert len(made) == 1 and len(seen) == 1
    # a local one-process reshard reads ahead (runner/readahead): the writer gets the context
    # built for the command with only its progress wrapped (to count the bytes copied), no
    # setting rebuilt
    assert seen[0] is made[0] or (
        dataclasses.replace(seen[0], progress=made[0].progress) == made[0]
        and seen[0].progress._inner is made[0].progress
    )
    ctx = made[0]
    assert (ctx.memory_budget, ctx.workers, ctx.overwrite) == (64 << 20, 3, True)
    assert ctx.slab_bytes == (64 << 20) // (2 * 3)


@pytest.mark.parametrize(
    "to,module,name",
    [
        ("torch", "ckptkit.formats.torch_save.format", "write_torch_save"),
        ("zero2", "ckptkit.formats.deepspeed.state_target", "write_zero_files"),
        ("hf", "ckptkit.formats.safetensors.format", "write_safetensors"),
    ],
)
def test_convert_hands_its_one_context_to_the_writer(tmp_path, made, monkeypatch, to, module, name):
    seen = _writer_spy(monkeypatch, importlib.import_module(module), name)
    args = ["--quiet", "convert", str(DATA / "fsdp2_w2"), str(tmp_path / "o"), "--to", to, "--workers", "2"]
    if to == "zero2":
        args += ["--ds-config", str(DATA / "deepspeed" / "z2_fp32_w2" / "ds_config.json")]
    res = CliRunner().invoke(cli_main.cli, args)
    assert res.exit_code == 0, res.output
    assert len(made) == 1 and len(seen) == 1 and seen[0] is made[0]
    assert made[0].workers == 2


def test_flags_win_over_the_environment_defaults(tmp_path, made, monkeypatch):
    monkeypatch.setattr(knobs, "MEMORY_BUDGET", 32 << 20)
    monkeypatch.setattr(knobs, "WORKERS", 7)
    res = CliRunner().invoke(cli_main.cli, ["--quiet", "verify", "--deep", str(DATA / "fsdp2_w2")])
    assert res.exit_code == 0, res.output
    assert (made[-1].memory_budget, made[-1].workers) == (32 << 20, 7)  # the environment's values
    res = CliRunner().invoke(
        cli_main.cli,
        ["--quiet", "verify", "--deep", str(DATA / "fsdp2_w2"), "--memory-budget", "8MiB", "--workers", "2"],
    )
    assert res.exit_code == 0, res.output
    assert (made[-1].memory_budget, made[-1].workers) == (8 << 20, 2)


def test_environment_variables_reach_a_fresh_context():
    env = dict(os.environ, CKPTKIT_MEMORY_BUDGET=str(96 << 20), CKPTKIT_WORKERS="5", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ckptkit.context import RunContext as R; c = R(); print(c.memory_budget, c.workers, c.slab_bytes)",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.stdout.split() == [str(96 << 20), "5", str((96 << 20) // 10)], out.stderr


def test_every_buffer_is_a_share_of_the_budget():
    ctx = RunContext(memory_budget=64 << 20, workers=4)
    assert ctx.slab_bytes == ctx.slab_bytes_for(2) == 8 << 20
    assert ctx.slab_bytes_for(4) * 4 * ctx.workers <= ctx.memory_budget
    assert knobs.slab_bytes(ctx.memory_budget, ctx.workers) == ctx.slab_bytes  # the knob agrees
    assert RunContext(memory_budget=1 << 10, workers=4).slab_bytes == 1 << 20  # never below one MiB
    assert RunContext(fixed_slab=64).slab_bytes_for(3) == 64


def test_convert_bit_identity_check_reads_within_the_budget(tmp_path, monkeypatch):
    """The tied-weight check (convert/model_roles.py) holds two slabs at once, each the context's share."""
    import ckptkit.convert.model_roles as model_roles
    from ckptkit.ops.convert import convert

    slabs: list[int] = []
    real = model_roles.bit_identical

    def spy(fetcher, a, b, slab_bytes):
        slabs.append(slab_bytes)
        return real(fetcher, a, b, slab_bytes)

    monkeypatch.setattr(model_roles, "bit_identical", spy)
    ctx = RunContext(memory_budget=4 << 20, workers=2)
    res = convert(str(DATA / "fsdp2_w2"), str(tmp_path / "o.pt"), "torch", ctx=ctx)
    assert slabs and all(2 * s * ctx.workers <= ctx.memory_budget for s in slabs)
    assert res.files == ["o.pt"]


def test_run_options_is_the_old_name_of_run_context(tmp_path):
    from ckptkit.ops.reshard import reshard

    assert RunOptions is RunContext
    opts = RunOptions(workers=2, overwrite=True)
    res = reshard(str(DATA / "fsdp2_w2"), str(tmp_path / "o"), 3, options=opts)  # the old keyword still works
    assert res.to_world_size == 3 and (tmp_path / "o" / ".metadata").exists()


def test_the_context_stops_at_its_check_points_after_a_ctrl_c():
    from ckptkit import interrupts

    ctx = RunContext()
    ctx.check()  # nothing pending: goes on
    interrupts.cancel()
    try:
        with pytest.raises(interrupts.Cancelled):
            ctx.check()
    finally:
        interrupts.reset()
