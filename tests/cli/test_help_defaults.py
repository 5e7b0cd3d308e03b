"""Help states built-in defaults and the variable that overrides them, never one run's environment.

The --memory-budget help said "default 512MiB" while CKPTKIT_MEMORY_BUDGET could make it anything,
and --workers showed whatever CKPTKIT_WORKERS held when the CLI was imported. Help is built at
import, so the check runs a fresh process with both variables set.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, subprocess_env


def test_help_names_the_default_and_its_variable():
    env = {**subprocess_env(), "CKPTKIT_MEMORY_BUDGET": "1000", "CKPTKIT_WORKERS": "9", "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "ckptkit", "reshard", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "(default 512MiB, or CKPTKIT_MEMORY_BUDGET in bytes)" in text, text
    assert "(default 4, or CKPTKIT_WORKERS)" in text and "default 9" not in text, text
