"""DeepSpeed engine checks, many per launch: DeepSpeed's start-up on CPU (imports, process group,
its ops) costs most of a small check's time, so the cases of one world size share one launch of
tests/dist/ds_engine_cases.py and each test then asserts its own case's result."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import ROOT, subprocess_env, torchrun_cmd


def run_engine_cases(world: int, cases: list[dict], folder: Path, timeout: float = 1200) -> dict[str, dict]:
    """Run `cases` ({"id", "check", "argv"}, see tests/dist/ds_engine_cases.py) in one launch of
    `world` processes; returns each case's result by id. A launch that wrote no result gives every
    case {"ok": False, "error": <the launch's output>}, so each test still fails on its own."""
    if not cases:
        return {}
    cases_file, result = folder / "cases.json", folder / "result.json"
    cases_file.write_text(json.dumps(cases, indent=1))
    cmd = torchrun_cmd(world) + [
        str(ROOT / "tests" / "dist" / "ds_engine_cases.py"),
        "--cases",
        str(cases_file),
        "--result",
        str(result),
    ]
    env = {**subprocess_env(), "DS_ACCELERATOR": "cpu"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        output = proc.stdout[-3000:] + proc.stderr[-3000:]
    except subprocess.TimeoutExpired as exc:
        output = f"the launch did not finish in {timeout} s: {exc}"
    if not result.exists():
        return {c["id"]: {"ok": False, "error": f"the launch wrote no result:\n{output}"} for c in cases}
    results = json.loads(result.read_text())["results"]
    missing = {"ok": False, "error": f"the launch did not report this case:\n{output}"}
    return {c["id"]: results.get(c["id"], missing) for c in cases}
