"""Benchmark (GPU): a training step's wait for its checkpoint on CUDA, ckptkit against torch DCP.

    python benchmarks/bench_gpu_save_load.py [--size-mb 1200] [--repeat 5] [--batch 8] [--nproc N] [--cpu]

bench_in_job.py's comparison with the model, its FSDP2 shards and AdamW state on the GPUs (nccl for
training, gloo for the saves' own groups): in one run, --repeat times each (median and min-max), a
training step with a save in it, `save -> forward + backward -> optimizer.step() -> durable`:
  returns / waits / stall   Checkpointer(async_save=True).save (the optimizer's tensors copied
                            into pinned staging buffers, reused across saves, on a side stream
                            while forward and backward run; optimizer.step() waits for that copy)
                            vs get_state_dict + dcp.async_save with its default stager (a blocking
                            copy to fresh CPU memory) on a gloo group of its own
  durable                   until Checkpointer.wait() / the future's .result()
  restore                   Checkpointer.restore  vs  get_state_dict + dcp.load + set_state_dict
and with --save-load ckptkit.save/load vs dcp.save/load. Every restore and load is checked equal to
the saved state bit for bit. One rank per GPU (--nproc, default: every visible GPU). Without CUDA it
says so and exits 0 without measuring; --cpu runs the same comparison on CPU (gloo, 2 ranks unless
--nproc) to check the script itself. Results go to docs/performance.md with the machine and the date.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1200, help="MB of state over all ranks (params + 2 Adam moments)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="rows of the forward + backward between save and step")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: one per GPU; 2 with --cpu)")
    ap.add_argument("--save-load", action="store_true", help="also ckptkit.save/load vs dcp.save/load")
    ap.add_argument("--cpu", action="store_true", help="run the same comparison on CPU (gloo)")
    ap.add_argument("--work", default="/tmp/ckptkit-bench-gpu")
    args = ap.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("skipped: this benchmark needs CUDA GPUs and found none (--cpu runs it on CPU)", file=sys.stderr)
        return
    sys.path.insert(0, HERE)
    import bench_in_job

    device = "cpu" if args.cpu else "cuda"
    nproc = args.nproc or (2 if args.cpu else torch.cuda.device_count())
    res = bench_in_job.measure(args.size_mb, args.repeat, args.work, args.batch, args.save_load, device, nproc)
    bench_in_job.print_result(res)
    if not all(res["equal"].values()):
        raise SystemExit("a restored or loaded state differs from the saved one")


if __name__ == "__main__":
    main()
