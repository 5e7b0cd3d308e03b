"""Benchmark (GPU): in-job save and load GB/s per GPU, ckptkit vs torch.distributed.checkpoint.

    torchrun --nproc_per_node G benchmarks/bench_gpu_save_load.py [--params 1B] [--dir /local/nvme/bench]

Builds a stack of Linear layers of about --params parameters on CUDA, shards it with FSDP2
(nccl), makes AdamW state with one step, then in the same run and on the same files system:
  dcp.save      vs  ckptkit.save      (state of get_state_dict, written by every rank)
  dcp.load      vs  ckptkit.load      (into the same sharded state dict)
  ckptkit.Checkpointer(async_save=True).save: time until it returns (staging to pinned memory)
Each is timed from a barrier to a barrier, page cache dropped before loads when root; the loaded
state is checked equal to the saved one. Rank 0 prints a table: seconds, GB/s per GPU and the
ratio ckptkit / torch. Results go to docs/performance.md with the machine and the date.
Needs CUDA; on a machine without a GPU it says so and exits 2.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

SIZES = {"125M": (12, 3200), "1B": (16, 8000), "4B": (32, 11200)}


def _barrier_time(fn) -> float:
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def _drop_caches() -> None:
    if dist.get_rank() == 0 and os.geteuid() == 0:
        os.system("sync; echo 1 > /proc/sys/vm/drop_caches")
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", choices=sorted(SIZES), default="1B")
    ap.add_argument("--dir", default="/tmp/ckptkit-bench-gpu")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs CUDA GPUs (none found)", file=sys.stderr)
        sys.exit(2)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptkit

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    layers, width = SIZES[args.params]
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width, device="cuda")).float().square().mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    local_bytes = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
                      for t in list(msd.values()) + [v for s in osd["state"].values() for v in s.values()])
    gb = local_bytes / 1e9
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    dist.barrier()
    rows = []
    t_dcp = _barrier_time(lambda: dcp.save(state, checkpoint_id=os.path.join(args.dir, "dcp")))
    t_ck = _barrier_time(lambda: ckptkit.save(state, os.path.join(args.dir, "ck")))
    rows.append(("save", t_dcp, t_ck))
    _drop_caches()
    t_dcp = _barrier_time(lambda: dcp.load(state, checkpoint_id=os.path.join(args.dir, "dcp")))
    _drop_caches()
    t_ck = _barrier_time(lambda: ckptkit.load(state, os.path.join(args.dir, "ck")))
    rows.append(("load", t_dcp, t_ck))
    ckpt = ckptkit.Checkpointer(os.path.join(args.dir, "async"), async_save=True)
    t_async = _barrier_time(lambda: ckpt.save(1, model, optim))
    ckpt.wait()
    if rank == 0:
        print(f"{world} GPU(s) {torch.cuda.get_device_name()}, {args.params} params, {gb:.2f} GB per GPU")
        print(f"{'op':<6}{'dcp s':>9}{'ckptkit s':>11}{'dcp GB/s/GPU':>14}{'ckptkit GB/s/GPU':>18}{'ratio':>8}")
        for op, a, b in rows:
            print(f"{op:<6}{a:>9.2f}{b:>11.2f}{gb / a:>14.2f}{gb / b:>18.2f}{b / a:>8.2f}")
        print(f"async save returned after {t_async:.2f} s (staging to pinned memory)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
