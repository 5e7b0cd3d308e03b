"""A careless user and an attacker, third pass: environment knobs, size and tolerance options,
fsspec URLs as SRC, write errors other than a full disk, and the in-job API.

Each test pins one promise of README.md / docs/cli.md / docs/hooks.md that main breaks today
(strict xfail: it fails now because of the bug and passes once it is fixed). Bad input gets one
`error: ...` sentence and exit 2 (docs/cli.md, "Exit status"); exit 3 ("internal error") and a
Python traceback are bugs; an API call refuses with a CkptkitError naming what is wrong.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "fixtures" / "data"
PLAIN = DATA / "plain_state_dict.pt"
DCP = DATA / "fsdp2_w2"


def _ckptkit(*args: str, env: dict | None = None, cwd: str | None = None, fsize: int | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m ckptkit ARGS` in a fresh interpreter; `env` adds variables, `fsize` caps the size
    of any file it writes (RLIMIT_FSIZE: Python ignores SIGXFSZ, so a write past it fails EFBIG)."""
    full_env = dict(os.environ)
    full_env.pop("CKPTKIT_FOLLOW_LINKS", None)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})

    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-m", "ckptkit", *map(str, args)], capture_output=True,
                          text=True, env=full_env, cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL,
                          preexec_fn=limit)


def _one_sentence(res: subprocess.CompletedProcess, code: int = 2) -> None:
    """The exit-status contract: `code`, one `error: ` line on stderr, no traceback."""
    detail = f"exit {res.returncode}\n--- stdout ---\n{res.stdout[-2000:]}\n--- stderr ---\n{res.stderr[-2000:]}"
    assert "Traceback" not in res.stdout + res.stderr, detail
    assert "internal error" not in res.stderr, detail
    assert res.returncode == code, detail
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), detail


# ---- environment knobs set to garbage ------------------------------------------------------------


@pytest.mark.parametrize("command", [
    ["consolidate", DCP, "out"],
    ["convert", "--to", "torch", DCP, "out.pt"],
    ["reshard", "--to", "3", DCP, "out"],
    ["reshard", "--to", "3", "--nproc", "2", DCP, "out"],
])
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
    res = _ckptkit("consolidate", "--overwrite", DCP, target, cwd=str(work) if out != "home" else str(tmp_path),
                   env={"HOME": str(home)})
    _one_sentence(res)
    assert "--overwrite would delete it" in res.stderr
    assert (work / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("command,name", [(["consolidate"], "out"), (["convert", "--to", "torch"], "out.pt")],
                         ids=["folder output", "file output"])
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
