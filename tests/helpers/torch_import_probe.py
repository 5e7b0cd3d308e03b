"""Whether a ckptkit command imported torch: the command runs in a fresh Python that reports
`"torch" in sys.modules` when it ends."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, subprocess_env

_PROBE = """
import sys
from cli.main import cli
try:
    cli(sys.argv[1:], prog_name="ckptkit")
finally:
    print("TORCH_IMPORTED=" + str("torch" in sys.modules))
"""


def torch_imported(args: list[str]) -> bool:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, env=subprocess_env(), cwd=str(ROOT)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [s for s in proc.stdout.splitlines() if s.startswith("TORCH_IMPORTED=")][-1]
    return line.endswith("True")
