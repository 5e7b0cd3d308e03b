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
import torch

import ckptkit
from ckptkit.errors import CkptkitError

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


@pytest.mark.xfail(strict=True, reason="an unknown fsspec protocol as SRC is 'internal error: ValueError: "
                                       "Protocol not known', exit 3 (as OUT it is one sentence)")
@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["diff", str(PLAIN)]])
def test_an_unknown_protocol_as_src_is_one_sentence(command):
    res = _ckptkit(*command, "nosuchproto://bucket/ckpt")
    _one_sentence(res)
    assert "nosuchproto://bucket/ckpt" in res.stderr


@pytest.mark.xfail(strict=True, reason="SRC zip://x is 'internal error: IsADirectoryError', exit 3")
def test_a_zip_url_that_names_no_archive_is_one_sentence(tmp_path):
    res = _ckptkit("inspect", "zip://x", cwd=str(tmp_path))
    _one_sentence(res)


@pytest.mark.xfail(strict=True, reason="ckptkit.load from an unknown protocol raises a bare ValueError, "
                                       "not a CkptkitError")
def test_load_from_an_unknown_protocol_is_a_ckptkit_error():
    with pytest.raises(CkptkitError, match="nosuchproto"):
        ckptkit.load({"w": torch.zeros(3)}, "nosuchproto://bucket/ckpt")


@pytest.mark.xfail(strict=True, reason="a file:// URL naming a file (not a folder) is mangled into "
                                       "'<cwd>/file:/<dir>: no such file or folder', exit 2")
def test_a_file_url_naming_a_torch_save_file_reads_like_its_path(tmp_path):
    by_path = _ckptkit("inspect", "--json", PLAIN)
    assert by_path.returncode == 0, by_path.stderr
    res = _ckptkit("inspect", "--json", f"file://{PLAIN}", cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"format": "torch_save"' in res.stdout


@pytest.mark.xfail(strict=True, reason="ckptkit.load from a file:// URL naming a torch.save file: "
                                       "NotACheckpointError on a mangled '<cwd>/file:/<dir>' path")
def test_load_from_a_file_url_naming_a_file(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.arange(3.0)}, path)
    state = ckptkit.load({"w": torch.zeros(3)}, f"file://{path}")
    assert torch.equal(state["w"], torch.arange(3.0))


# ---- write errors other than a full disk ----------------------------------------------------------
