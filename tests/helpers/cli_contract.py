"""What the hostile tests of options, URLs, writes and the in-job API share: the fixtures they
attack, a fresh `python -m ckptkit` run (with added variables or a file size cap) and the
exit-status contract it must keep.

Each test there pins a promise of README.md / docs/cli.md / docs/hooks.md against a careless user
or an attacker: bad input gets one `error: ...` sentence and exit 2 (docs/cli.md, "Exit
status"); exit 3 ("internal error") and a Python traceback are bugs; an API call refuses with a
CkptkitError naming what is wrong.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "fixtures" / "data"
PLAIN = DATA / "plain_state_dict.pt"
DCP = DATA / "fsdp2_w2"


def run_ckptkit(
    *args: str, env: dict | None = None, cwd: str | None = None, fsize: int | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """`python -m ckptkit ARGS` in a fresh interpreter; `env` adds variables, `fsize` caps the size
    of any file it writes (RLIMIT_FSIZE: Python ignores SIGXFSZ, so a write past it fails EFBIG)."""
    full_env = dict(os.environ)
    full_env.pop("CKPTKIT_FOLLOW_LINKS", None)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})

    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [sys.executable, "-m", "ckptkit", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        preexec_fn=limit,
    )


def one_sentence(res: subprocess.CompletedProcess, code: int = 2) -> None:
    """The exit-status contract: `code`, one `error: ` line on stderr, no traceback."""
    detail = f"exit {res.returncode}\n--- stdout ---\n{res.stdout[-2000:]}\n--- stderr ---\n{res.stderr[-2000:]}"
    assert "Traceback" not in res.stdout + res.stderr, detail
    assert "internal error" not in res.stderr, detail
    assert res.returncode == code, detail
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), detail
