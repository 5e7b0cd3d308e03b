"""Run a command and report wall time and its peak RSS (VmHWM of its own address space).

ru_maxrss of a forked child starts from the parent's high-water mark on Linux, so Python
children report VmHWM themselves; for non-Python commands we poll /proc (coarse but honest).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

PY_WRAPPER = """
import runpy, sys
target = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    if target == "-m":
        sys.argv = sys.argv[1:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")
finally:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
    sys.stderr.write("VMHWM_KB=" + hwm + "\\n")
"""


def du(path: str) -> int:
    """Bytes of the files under `path`."""
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def drop_caches() -> bool:
    """Cold page cache where permitted (root); returns whether it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def run_python(args: list[str], env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS MB) of `python args...` (args: ["-m", "mod", ...] or [script, ...])."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PY_WRAPPER, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"command failed: {args}\n{proc.stderr[-3000:]}")
    hwm = [l for l in proc.stderr.splitlines() if l.startswith("VMHWM_KB=")][-1]
    return wall, int(hwm.split("=")[1]) / 1024


def run_shell(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MB polled every 10 ms) of a non-Python command."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        peak = max(peak, int(line.split()[1]))
        except OSError:
            pass
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"command failed: {cmd}")
    return wall, peak / 1024


def machine_line() -> str:
    import platform
    import time

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"machine: {platform.machine()}, {os.cpu_count()} cores, {ram:.0f} GiB RAM; date {time.strftime('%Y-%m-%d')}"


def print_table(rows: list[tuple[str, str, float, float]]) -> None:
    """rows: (operation, tool, wall seconds, peak RSS MB) as a Markdown table."""
    print("| operation | tool | wall (s) | peak RSS (MB) |\n|---|---|---:|---:|")
    for op, tool, wall, rss in rows:
        print(f"| {op} | {tool} | {wall:.2f} | {rss:.0f} |")


def median_of(runs: int, measure, prepare=None) -> tuple[float, float]:
    """Median wall time and highest peak RSS of `runs` cold runs (drop_caches before each;
    `prepare` removes the previous run's output first). This VM's disk is noisy."""
    import statistics

    walls, rss = [], []
    for _ in range(runs):
        if prepare is not None:
            prepare()
        drop_caches()
        wall, peak = measure()
        walls.append(wall)
        rss.append(peak)
    return statistics.median(walls), max(rss)


def parse_bench_args(doc: str, sizes: dict, default: str, work: str):
    """The options every one-format benchmark takes: --params (a key of `sizes`), --work, --keep,
    --repeat; returns (args, the folder for this size)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", choices=sorted(sizes), default=default)
    ap.add_argument("--work", default=work)
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint for reruns")
    ap.add_argument("--repeat", type=int, default=3, help="cold runs per command; the median wall is reported")
    args = ap.parse_args()
    folder = os.path.join(args.work, args.params)
    os.makedirs(folder, exist_ok=True)
    return args, folder


def finish(args, work: str, agree: bool) -> None:
    """Remove the work folder unless --keep; fail the run when the tools' outputs differ."""
    import shutil

    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if not agree:
        raise SystemExit("outputs differ")
