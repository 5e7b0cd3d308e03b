"""Benchmark: ckptkit convert --to ds-universal against DeepSpeed's own ds_to_universal.

    python benchmarks/bench_universal.py [--params 25M|100M] [--work /tmp/ckptkit-bench-universal] [--keep]

1. Writes a real checkpoint: DeepSpeed on 2 CPU ranks (gloo), ZeRO-2, bf16, AdamW, one step;
   --params 25M -> ~0.35 GB (fp32 masters + two moments + bf16 module), 100M -> ~1.4 GB.
2. Cold page cache before each measured command (root only); median wall time and highest peak
   RSS (the whole process tree for ds_to_universal, which forks its workers) of --repeat runs:
   - ckptkit convert SRC OUT --to ds-universal
   - python -m deepspeed.checkpoint.ds_to_universal --input_folder SRC/global_step1
       --output_folder OUT/global_step1_universal --inject_missing_state  (its default workers:
       4 extract, 2 merge processes; their RSS is summed, shared pages counted in each)
   - the same with --num_extract_workers 1 --num_merge_workers 1
3. Checks that both outputs hold the same fp32 master, exp_avg, exp_avg_sq and step for every
   parameter (torch.equal), and prints a table with the ratios.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _deepspeed_writer import write_zero_checkpoint  # noqa: E402
from _measure import (  # noqa: E402
    drop_caches, du, finish, machine_line, median_of, parse_bench_args, print_table, run_python,
)

SIZES = {"25M": (24, 1024), "100M": (24, 2048)}
TAG = "global_step1"


def run_tree(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, peak summed RSS MB of the process and its children, polled every 10 ms)."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    top = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            procs = [top, *top.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"command failed: {cmd}\n{proc.stderr.read()[-3000:].decode(errors='replace')}")
    return wall, peak / 2**20


def same_values(ours: str, theirs: str) -> tuple[bool, int]:
    """Every parameter folder of `theirs` holding optimizer state: the same tensors and step in `ours`."""
    import torch

    compared = 0
    for name in sorted(os.listdir(theirs)):
        folder = os.path.join(theirs, name)
        if not os.path.isdir(folder) or not os.path.exists(os.path.join(folder, "exp_avg.pt")):
            continue
        for state in sorted(os.listdir(folder)):
            a = torch.load(os.path.join(folder, state), weights_only=True)
            b = torch.load(os.path.join(ours, name, state), weights_only=True)
            if state == "step.pt":
                ok = a == b
            else:
                ok = torch.equal(a["param"].flatten(), b["param"].flatten())
            if not ok:
                print(f"differ: {name}/{state}")
                return False, compared
            compared += 1
    return compared > 0, compared


def main() -> None:
    args, work = parse_bench_args(__doc__, SIZES, "25M", "/tmp/ckptkit-bench-universal")
    layers, width = SIZES[args.params]
    src = os.path.join(work, "zero2_w2")
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    if not os.path.exists(os.path.join(src, "latest")):
        print(f"writing a real DeepSpeed ZeRO-2 bf16 checkpoint ({args.params} params, 2 ranks) ...", flush=True)
        write_zero_checkpoint(src, work, 2, layers, width, env)
    size = du(src)
    cold = drop_caches()
    ck, ds = os.path.join(work, "ck_uc"), os.path.join(work, "ds_uc")

    def fresh(path):
        return lambda: shutil.rmtree(path, ignore_errors=True)

    ds_cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
              os.path.join(src, TAG), "--output_folder", os.path.join(ds, f"{TAG}_universal"),
              "--inject_missing_state"]  # fmt: skip
    n = args.repeat
    rows = [
        ("convert to universal", "ckptkit convert --to ds-universal", *median_of(n, lambda: run_python(
            ["-m", "ckptkit", "--quiet", "convert", src, ck, "--to", "ds-universal"], env), fresh(ck))),
        ("convert to universal", "ds_to_universal (default workers)", *median_of(n, lambda: run_tree(
            ds_cmd, env), fresh(ds))),
        ("convert to universal", "ds_to_universal (1 worker each)", *median_of(n, lambda: run_tree(
            ds_cmd + ["--num_extract_workers", "1", "--num_merge_workers", "1"], env), fresh(ds))),
    ]  # fmt: skip
    agree, compared = same_values(
        os.path.join(ck, f"{TAG}_universal", "zero"), os.path.join(ds, f"{TAG}_universal", "zero")
    )
    print(f"\n{machine_line()}; checkpoint {size / 1e9:.2f} GB ({args.params} params, ZeRO-2 bf16, 2 ranks, "
          f"AdamW); cold cache: {'yes' if cold else 'no (not root)'}; {n} runs each")  # fmt: skip
    print_table(rows)
    c, d, one = rows
    print(
        f"\nckptkit/ds_to_universal wall {c[2] / d[2]:.2f}x (1 worker: {c[2] / one[2]:.2f}x), peak RSS "
        f"{c[3] / d[3]:.2f}x (1 worker: {c[3] / one[3]:.2f}x); {compared} state files equal: {agree}"
    )
    finish(args, work, agree)


if __name__ == "__main__":
    main()
