"""Benchmark: ckptkit on a real DeepSpeed ZeRO-3 checkpoint against DeepSpeed's own tool and cp.

    python benchmarks/bench_zero3.py [--params 100M|400M] [--work /tmp/ckptkit-bench-zero3] [--keep]

1. Writes a real checkpoint: DeepSpeed on 2 CPU ranks (gloo), ZeRO-3, bf16, AdamW, one step;
   ~100M parameters -> ~1.2 GB (fp32 masters + two moments), --params 400M -> ~4.6 GB.
2. Cold page cache before each measured command (root only); wall time and peak RSS of:
   - ckptkit consolidate      vs  DeepSpeed's zero_to_fp32.py --safe_serialization
   - ckptkit reshard 2->3     vs  cp -r of the same folder
3. Checks that the two consolidated safetensors are equal bit for bit and prints a table with
   the ratios. zero_to_fp32.py needs huggingface_hub (its --max_shard_size default imports it).
"""
from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _deepspeed_writer import write_zero_checkpoint, writer_script  # noqa: E402
from _measure import (  # noqa: E402
    drop_caches, du, finish, machine_line, median_of, parse_bench_args, print_table, run_python, run_shell,
)

SIZES = {"100M": (24, 2048), "400M": (24, 4096)}

WRITER = writer_script(3)  # run.py writes the same source


def main() -> None:
    args, work = parse_bench_args(__doc__, SIZES, "100M", "/tmp/ckptkit-bench-zero3")
    try:
        import huggingface_hub  # noqa: F401  (zero_to_fp32.py needs it)
    except ImportError:
        raise SystemExit("zero_to_fp32.py needs huggingface_hub: pip install huggingface_hub")
    layers, width = SIZES[args.params]
    src = os.path.join(work, "zero3_w2")
    if not os.path.exists(os.path.join(src, "latest")):
        print(f"writing a real DeepSpeed ZeRO-3 bf16 checkpoint ({args.params} params, 2 ranks) ...", flush=True)
        write_zero_checkpoint(src, work, 3, layers, width, {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    size = du(src)
    env = {"DS_ACCELERATOR": "cpu"}
    cold = drop_caches()

    def fresh(*names):
        return lambda: [shutil.rmtree(os.path.join(work, n), ignore_errors=True) for n in names]

    n = args.repeat
    rows = [
        ("consolidate", "ckptkit", *median_of(n, lambda: run_python(
            ["-m", "ckptkit", "--quiet", "consolidate", src, os.path.join(work, "ck_st")], env), fresh("ck_st"))),
        ("consolidate", "zero_to_fp32.py --safe_serialization", *median_of(n, lambda: run_python(
            [os.path.join(src, "zero_to_fp32.py"), src, os.path.join(work, "ds_st"), "--safe_serialization"], env),
            fresh("ds_st"))),
        ("reshard 2->3", "ckptkit", *median_of(n, lambda: run_python(
            ["-m", "ckptkit", "--quiet", "reshard", src, os.path.join(work, "ck_r3"), "--to", "3"], env),
            fresh("ck_r3"))),
        ("reshard 2->3", "cp -r", *median_of(n, lambda: run_shell(["cp", "-r", src, os.path.join(work, "cp")]),
                                            fresh("cp"))),
        ("reshard 2->3", "cp -r && sync (same durability)", *median_of(n, lambda: run_shell(
            ["sh", "-c", f"cp -r '{src}' '{os.path.join(work, 'cp')}' && sync"]), fresh("cp"))),
    ]

    import torch
    from safetensors.torch import load_file
    a = load_file(os.path.join(work, "ck_st", "model.safetensors"))
    b = load_file(os.path.join(work, "ds_st", "model.safetensors"))
    agree = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    print(f"\n{machine_line()}; checkpoint {size / 1e9:.2f} GB ({args.params} params, ZeRO-3 bf16, 2 ranks, "
          f"AdamW); cold cache: {'yes' if cold else 'no (not root)'}")
    print_table(rows)
    c, z, r, cp, cps = rows
    print(f"\nconsolidate: ckptkit/zero_to_fp32 wall {c[2] / z[2]:.2f}x, RSS {c[3] / z[3]:.2f}x; "
          f"reshard/cp -r wall {r[2] / cp[2]:.2f}x (vs cp -r && sync {r[2] / cps[2]:.2f}x); "
          f"outputs agree bit for bit: {agree}")
    finish(args, work, agree)


if __name__ == "__main__":
    main()
