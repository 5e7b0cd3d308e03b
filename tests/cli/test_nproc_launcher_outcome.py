"""What the --nproc launcher reports when a Ctrl-C reaches it while its processes end: their
outcome decides, as for one process. Every process succeeded (rank 0 committed OUT): exit 0, and
the Ctrl-C that came too late is not reported, since exit 130 promises no output. A job the Ctrl-C
stopped: exit 130. The processes are stand-ins that end with the given codes while the Ctrl-C
arrives, the launcher's own handler having set `cancelled` (cli/sigint.py)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ckptkit import interrupts
from ckptkit_cli import sigint, spawn
from ckptkit_cli.main import cli
from conftest import DATA


class EndsDuringCtrlC:
    """A rank process that has ended with `code` when the launcher first looks; the Ctrl-C (to the
    launcher alone) lands just before, while the launcher waits."""

    def __init__(self, code: int) -> None:
        self.code, self.signals = code, []

    def poll(self) -> int:
        interrupts.cancel()  # what the launcher's Ctrl-C handler does while its job runs
        return self.code

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)

    def kill(self) -> None:
        raise AssertionError("a process that ended is never killed")


@pytest.fixture
def ranks(monkeypatch):
    """Start stand-ins instead of rank processes; each test sets the codes they end with."""
    started: list[EndsDuringCtrlC] = []
    codes: list[int] = []

    def popen(argv, env):
        started.append(EndsDuringCtrlC(codes[len(started)]))
        return started[-1]

    monkeypatch.setattr(spawn.subprocess, "Popen", popen)
    monkeypatch.setattr(sigint, "_announced", [False])
    yield codes, started
    interrupts.reset()


def _reshard(out) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["reshard", str(DATA / "fsdp2_w2"), str(out), "--to", "2", "--nproc", "2"])
    return res.exit_code, res.output


def test_a_ctrl_c_after_every_process_succeeded_is_a_success(ranks, tmp_path):
    codes, started = ranks
    codes += [0, 0]
    code, output = _reshard(tmp_path / "out")
    assert len(started) == 2 and all(p.signals for p in started)  # the Ctrl-C was passed on
    assert code == 0, output
    assert "interrupted" not in output
    assert interrupts.committed.is_set() and not interrupts.cancelled.is_set()


@pytest.mark.parametrize("rank_codes", [[130, 130], [0, 130], [130, 2]])
def test_a_ctrl_c_that_stopped_a_process_is_an_interrupt(ranks, tmp_path, rank_codes):
    codes, _ = ranks
    codes += rank_codes
    code, output = _reshard(tmp_path / "out")
    assert code == 130, output
    assert output.strip() == "interrupted"
