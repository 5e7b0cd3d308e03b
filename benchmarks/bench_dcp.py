"""Benchmark: ckptkit on a real FSDP2 DCP checkpoint against the tools a user would otherwise use.

    python benchmarks/bench_dcp.py [--params 100M|400M] [--work /tmp/ckptkit-bench] [--keep]

1. Writes a real checkpoint: torchrun, 2 CPU ranks (gloo), FSDP2 (fully_shard) model of the chosen
   size with AdamW state (params + exp_avg + exp_avg_sq, fp32: ~1.2 GB at 100M, ~4.6 GB at 400M).
2. With a cold page cache before each run (root only), measures wall time and peak RSS of:
   - ckptkit consolidate  vs  torch's own path: _load_state_dict_from_keys(model keys) + safetensors.save_file
   - ckptkit reshard 2->3 vs  cp -r of the same folder
3. Checks the consolidated safetensors equal the torch path's bit for bit, prints a table and the
   ratios. Copy the table into docs/performance.md with the machine and the date.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (  # noqa: E402
    drop_caches, du, finish, machine_line, median_of, parse_bench_args, print_table, run_python, run_shell,
)

SIZES = {"100M": (24, 2048), "400M": (24, 4096)}  # (layers, width): layers * width^2 params

WRITER = r"""
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
layers, width, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=True) for _ in range(layers)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(4, width)
model(x).square().mean().backward()
optim.step()
msd, osd = get_state_dict(model, optim)
dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
dist.barrier()
os._exit(0)
"""

TORCH_PATH = r"""
import sys, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
import torch.distributed.checkpoint as dcp
src, out = sys.argv[1], sys.argv[2]
md = dcp.FileSystemReader(src).read_metadata()
keys = {k for k in md.state_dict_metadata if k.startswith("model.")}
sd = _load_state_dict_from_keys(keys, checkpoint_id=src)
save_file({k: v.contiguous() for k, v in sd["model"].items()}, out, metadata={"format": "pt"})
"""


def main() -> None:
    args, work = parse_bench_args(__doc__, SIZES, "100M", "/tmp/ckptkit-bench")
    layers, width = SIZES[args.params]
    src = os.path.join(work, "dcp_w2")
    if not os.path.exists(os.path.join(src, ".metadata")):
        print(f"writing a real FSDP2 DCP checkpoint ({args.params} params, 2 ranks) ...", flush=True)
        script = os.path.join(work, "writer.py")
        open(script, "w").write(WRITER)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
                        str(layers), str(width), src], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    size = du(src)
    torch_script = os.path.join(work, "torch_path.py")
    open(torch_script, "w").write(TORCH_PATH)

    cold = drop_caches()

    def fresh(*names, make=None):
        def prepare():
            for n in names:
                shutil.rmtree(os.path.join(work, n), ignore_errors=True)
            if make:
                os.makedirs(os.path.join(work, make))
        return prepare

    n = args.repeat
    rows = [
        ("consolidate", "ckptkit", *median_of(n, lambda: run_python(
            ["-m", "ckptkit", "--quiet", "consolidate", src, os.path.join(work, "ck_st")]), fresh("ck_st"))),
        ("consolidate", "torch load + save_file", *median_of(n, lambda: run_python(
            [torch_script, src, os.path.join(work, "torch_st", "model.safetensors")]),
            fresh("torch_st", make="torch_st"))),
        ("reshard 2->3", "ckptkit", *median_of(n, lambda: run_python(
            ["-m", "ckptkit", "--quiet", "reshard", src, os.path.join(work, "ck_r3"), "--to", "3"]),
            fresh("ck_r3"))),
        ("reshard 2->3", "cp -r", *median_of(n, lambda: run_shell(["cp", "-r", src, os.path.join(work, "cp")]),
                                            fresh("cp"))),
        ("reshard 2->3", "cp -r && sync (same durability)", *median_of(n, lambda: run_shell(
            ["sh", "-c", f"cp -r '{src}' '{os.path.join(work, 'cp')}' && sync"]), fresh("cp"))),
    ]

    from safetensors.torch import load_file
    a = load_file(os.path.join(work, "ck_st", "model.safetensors"))
    b = load_file(os.path.join(work, "torch_st", "model.safetensors"))
    import torch
    agree = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    print(f"\n{machine_line()}; checkpoint {size / 1e9:.2f} GB ({args.params} params, FSDP2 2 ranks, fp32 + "
          f"AdamW); cold cache: {'yes' if cold else 'no (not root)'}")
    print_table(rows)
    c, t, r, cp, cps = rows
    print(f"\nconsolidate: ckptkit/torch wall {c[2] / t[2]:.2f}x, RSS {c[3] / t[3]:.2f}x; "
          f"reshard/cp -r wall {r[2] / cp[2]:.2f}x (vs cp -r && sync {r[2] / cps[2]:.2f}x); "
          f"outputs agree bit for bit: {agree}")
    finish(args, work, agree)


if __name__ == "__main__":
    main()
