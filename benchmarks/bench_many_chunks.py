"""verify --deep and consolidate of one DCP tensor stored as N chunks (rows, columns, 2-D blocks).

Usage: python benchmarks/bench_many_chunks.py N [N ...] [--layouts columns,rows,blocks]
       [--timeout S] [--code DIR]
Each checkpoint is written by tests/index/test_piece_scaling.py's builder (torch.save archives and
torch's Metadata, as FileSystemWriter lays them out). `--code DIR` runs the commands with DIR
first on PYTHONPATH (a checkout of another commit's ckptkit, for before/after in one run).
Prints one line per run: layout, N, command, seconds (or '> S' when stopped at the timeout).
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "index"))
sys.path.insert(0, str(ROOT / "tests"))

from test_piece_scaling import _grid, write_chunked  # noqa: E402


def layout(name: str, n: int) -> tuple[tuple[int, ...], list]:
    if name == "rows":
        return (n, 4), _grid((n, 4), (1, 4))
    if name == "columns":
        return (4, n), _grid((4, n), (4, 1))
    side = int(math.isqrt(n))   # blocks: side x side cells of 2 x 2
    return (2 * side, 2 * (n // side)), _grid((2 * side, 2 * (n // side)), (2, 2))


def timed(args: list[str], code: str | None, timeout: float) -> str:
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = code
    start = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-m", "ckptkit", *args], capture_output=True, text=True,
                             env=env, timeout=timeout, cwd=tempfile.gettempdir())  # not the checkout's ckptkit
    except subprocess.TimeoutExpired:
        return f"> {timeout:.0f}"
    took = time.monotonic() - start
    return f"{took:.1f}" if res.returncode == 0 else f"exit {res.returncode}: {res.stderr.strip()[-200:]}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("counts", type=int, nargs="+")
    p.add_argument("--layouts", default="columns,rows,blocks")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--code", default=None)
    a = p.parse_args()
    for name in a.layouts.split(","):
        for n in a.counts:
            with tempfile.TemporaryDirectory() as tmp:
                shape, boxes = layout(name, n)
                src = Path(tmp) / "ckpt"
                write_chunked(src, shape, boxes)
                for cmd in (["verify", "--deep", str(src)], ["consolidate", str(src), str(Path(tmp) / "o.safetensors")]):
                    print(f"{name:8} {len(boxes):>7} {cmd[0]:12} {timed(cmd, a.code, a.timeout)}", flush=True)


if __name__ == "__main__":
    main()
