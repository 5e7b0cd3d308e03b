"""Benchmark: ckptkit reshard --to tp=..,pp=.. of a Megatron-Core checkpoint against MCore's own
load-and-save at the new layout.

    python benchmarks/bench_mcore_reshard.py [--fixture tp2_swiglu_gqa] [--to 1,1] [--repeat 3]

The source is a committed fixture written by megatron-core (fixtures/data/mcore/, a 2-layer model
of ~85 KB): what is measured is each tool's fixed cost, not its bandwidth. Median wall time of
--repeat runs of each, in the same run:
  - ckptkit reshard SRC OUT --to tp=T,pp=P  (one process)
  - fixtures/mcore_load_check.py: T*P ranks build the model and optimizer at the new layout,
    dist_checkpointing.load them from SRC, dist_checkpointing.save them again (what a Megatron
    user does without ckptkit)
Then checks that both outputs hold the same tensors (torch's DCP loader, torch.equal).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "fixtures"))
sys.path.insert(0, os.path.join(REPO, "tests", "helpers"))
from _measure import machine_line, run_python  # noqa: E402

ITER = "iter_0000002"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default="tp2_swiglu_gqa")
    ap.add_argument("--to", default="1,1", help="T,P: the target tp and pp")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    tp, pp = (int(x) for x in a.to.split(","))
    import mcore_load_check
    import torch
    from mcore_dcp import global_tensors

    src = os.path.join(REPO, "fixtures", "data", "mcore", a.fixture)
    work = tempfile.mkdtemp(prefix="ckptkit-bench-mcore-")
    ours, theirs = [], []
    for i in range(a.repeat):
        out = os.path.join(work, f"ckptkit{i}")
        wall, _ = run_python(["-m", "ckptkit", "reshard", src, out, "--to", f"tp={tp},pp={pp}", "-q"])
        ours.append(wall)
        t0 = time.perf_counter()
        mcore_load_check.run(os.path.join(src, ITER), os.path.join(work, f"mcore{i}"), a.fixture, tp, pp)
        theirs.append(time.perf_counter() - t0)
    a_t = global_tensors(os.path.join(work, "ckptkit0", ITER))
    b_t = global_tensors(os.path.join(work, "mcore0"))
    agree = set(a_t) == set(b_t) and all(torch.equal(a_t[k], b_t[k]) for k in a_t)
    print(machine_line())
    print(f"{a.fixture} -> tp={tp},pp={pp}: median of {a.repeat}")
    print(f"| ckptkit reshard | {statistics.median(ours):.2f} s |")
    print(f"| MCore load + save ({tp * pp} ranks) | {statistics.median(theirs):.2f} s |")
    print(f"ratio MCore / ckptkit: {statistics.median(theirs) / statistics.median(ours):.1f}x; outputs agree: {agree}")
    shutil.rmtree(work, ignore_errors=True)
    if not agree:
        raise SystemExit("the two outputs differ")


if __name__ == "__main__":
    main()
