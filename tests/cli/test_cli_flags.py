"""Global CLI flags: --quiet prints nothing but errors, --debug shows the traceback."""

from __future__ import annotations

from click.testing import CliRunner

from ckptkit_cli.main import cli
from conftest import DATA, ROOT


def test_quiet_prints_nothing_on_success(tmp_path):
    res = CliRunner().invoke(cli, ["--quiet", "consolidate", str(DATA / "fsdp2_w2"), str(tmp_path / "o")])
    assert res.exit_code == 0 and res.output == ""
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_errors_are_one_sentence_and_debug_adds_the_traceback(tmp_path):
    plain = CliRunner().invoke(cli, ["inspect", str(tmp_path / "missing")])
    assert plain.exit_code == 2
    assert plain.output.strip() == f"error: {tmp_path / 'missing'}: no such file or folder"
    debug = CliRunner().invoke(cli, ["--debug", "inspect", str(tmp_path / "missing")])
    assert debug.exit_code == 2 and "Traceback" in debug.output and "NotACheckpointError" in debug.output


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path):
    res = CliRunner().invoke(cli, ["reshard", str(DATA / "fsdp2_w2"), str(tmp_path / "r"), "--to", "3"])
    assert res.exit_code == 0
    # no bar (carriage returns, tqdm's "|" meter); the one rate shown is the closing line's
    assert "\r" not in res.output and "it/s" not in res.output and "%|" not in res.output
    assert [line for line in res.output.splitlines() if "B/s" in line] == [res.output.splitlines()[-1]]


def test_progress_bar_on_a_terminal(monkeypatch, capsys):
    """On a terminal the CLI backs ckptkit's Progress with tqdm (and not with --quiet)."""
    import io
    import sys

    from ckptkit_cli.progress import make_progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    fake = Tty()
    monkeypatch.setattr(sys, "stderr", fake)
    quiet = make_progress(quiet=True)
    quiet.start(1000, "quiet")
    quiet.advance(1000)
    quiet.close()
    assert fake.getvalue() == ""  # --quiet shows nothing, even on a terminal
    bar = make_progress(quiet=False)
    assert bar.mode == "bar"
    bar.start(1000, "reshard")
    bar.advance(1000)
    bar.close()
    assert "reshard" in fake.getvalue()


def test_command_scoped_options_end_with_their_command(tmp_path):
    """--tp-rules, --partition-method and --layer-types hold for the command that gives them, not
    for the next call in the same process (an API call after an in-process CLI run once reused a
    stale --layer-types and refused a pipeline reshard), whether the command succeeds or fails."""
    from ckptkit.convert.tp_rules import chosen_rules_file
    from ckptkit.formats.deepspeed.pipeline_partition import chosen_layer_types, chosen_partition_method

    rules = ROOT / "docs" / "tp_rules.partial.json"
    for to in ("3", "pp=0"):  # a reshard that runs, and one refused after the options were taken
        res = CliRunner().invoke(
            cli,
            [
                "reshard",
                str(DATA / "fsdp2_w2"),
                str(tmp_path / f"r{to}"),
                "--to",
                to,
                "--tp-rules",
                str(rules),
                "--partition-method",
                "type:layer",
                "--layer-types",
                "Embed,Layer*2,Head",
            ],
        )
        assert (res.exit_code == 0) == (to == "3"), res.output
        assert chosen_rules_file() is None
        assert chosen_layer_types() is None
        assert chosen_partition_method() == "parameters"
