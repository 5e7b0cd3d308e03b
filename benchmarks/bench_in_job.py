"""Benchmark (CPU): in-job saves and loads, ckptkit against torch.distributed.checkpoint.

    python benchmarks/bench_in_job.py [--size-mb 1200] [--repeat 3] [--work /tmp/ckptkit-bench-injob]

Launches itself under torchrun on 2 ranks (gloo). Each rank builds a stack of Linear layers with
about --size-mb MB of state in total (fp32 parameters + AdamW's exp_avg and exp_avg_sq, over both
ranks), shards it with FSDP2 (fully_shard) and takes one AdamW step. Then, in the same run,
--repeat times each (median reported, the order of the two tools alternating between repeats):
  blocked   Checkpointer(async_save=True).save   vs  get_state_dict + dcp.async_save: until the call returns
  durable   the same save until Checkpointer.wait() returns  vs  until the future's .result():
            measured from the call
  restore   Checkpointer.restore                  vs  get_state_dict + dcp.load + set_state_dict
  save      ckptkit.save                          vs  dcp.save       (state of get_state_dict)
  load      ckptkit.load                          vs  dcp.load       (into the same state dict)
One Checkpointer serves the whole run, as in training (its background process group is made once;
keep is high enough that retention deletes nothing inside a timed save; restore takes the step just
saved). Times are the slowest rank's (a barrier before each call; each rank times its own call). The page
cache is synced before every timed call, and dropped too when run as root (so each starts alike). After every restore and load the
model and optimizer state (each rank's shards) must equal what was saved bit for bit (torch.equal),
for both tools; the state is scrambled before each so a load that does nothing cannot pass. A
small untimed save and load with both tools first pays the one-time imports. Prints a Markdown
table with the ratios ckptkit / torch, the machine line and the date; exits 1 when a check failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LAYERS = 16
OPS = [
    ("blocked (async save returns)", "Checkpointer(async_save=True).save", "dcp.async_save"),
    ("durable (async save on disk)", "Checkpointer.wait()", "dcp.async_save future .result()"),
    ("restore", "Checkpointer.restore", "dcp.load + set_state_dict"),
    ("save", "ckptkit.save", "dcp.save"),
    ("load", "ckptkit.load", "dcp.load"),
]


# ---- the launcher --------------------------------------------------------------------------

def measure(size_mb: int, repeat: int, work: str) -> dict:
    """Run the 2-rank job in a fresh folder under `work` (removed afterwards) and return its results."""
    import tempfile

    os.makedirs(work, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="in_job-", dir=work)  # removed whole afterwards
    result = os.path.join(scratch, "in_job.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    try:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        os.path.abspath(__file__), "--worker", "--size-mb", str(size_mb), "--repeat",
                        str(repeat), "--work", scratch, "--json", result], check=True, env=env)
        with open(result) as f:
            return json.load(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def print_result(res: dict) -> None:
    print(f"\n### In-job saves and loads: {res['gb']:.2f} GB of state (FSDP2 + AdamW, 2 ranks, gloo), "
          f"median of {res['repeat']}\n")
    print(f"{res['machine']}; page cache dropped before every timed call: {'yes' if res['cold'] else 'no (not root)'}\n")
    print("| operation | ckptkit | torch | ckptkit (s) | torch (s) | ckptkit / torch |\n|---|---|---|---:|---:|---:|")
    for op, ck_tool, torch_tool in OPS:
        ck, th = res["times"][op]["ckptkit"], res["times"][op]["torch"]
        print(f"| {op} | {ck_tool} | {torch_tool} | {ck:.2f} | {th:.2f} | {ck / th:.2f}x |")
    print(f"\n- restored and loaded state equal to the saved state bit for bit: {res['equal']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1200, help="MB of state over both ranks (params + 2 Adam moments)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default="/tmp/ckptkit-bench-injob")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    res = measure(args.size_mb, args.repeat, args.work)
    print_result(res)
    if not all(res["equal"].values()):
        raise SystemExit("a restored or loaded state differs from the saved one")


# ---- the job (every rank) ------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckptkit
    from _measure import machine_line

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params = args.size_mb * 1e6 / 12  # fp32 weights + exp_avg + exp_avg_sq
    width = max(64, int(math.sqrt(params / LAYERS)) // 64 * 64)
    model, optim = _build(LAYERS, width)
    cold = os.geteuid() == 0

    def local_state() -> list:
        msd, osd = get_state_dict(model, optim)
        return _tensors({"model": msd, "optim": osd})

    local_bytes = sum(t.numel() * t.element_size() for t in local_state())
    total = torch.tensor([float(local_bytes)])
    dist.all_reduce(total)
    want = [t.clone() for t in local_state()]

    def scramble() -> None:
        with torch.no_grad():
            for t in local_state():
                t.fill_(7)
        if any(torch.equal(a, b) for a, b in zip(local_state(), want)):  # the check would prove nothing
            raise SystemExit("scrambling did not reach the model's and optimizer's own tensors")

    def equal() -> bool:
        ok = torch.tensor([float(all(torch.equal(a, b) for a, b in zip(local_state(), want)))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def drop() -> None:
        """Every timed call starts alike: nothing left to write back, and (as root) a cold cache."""
        if rank == 0:
            os.sync()
            if cold:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("1\n")
        dist.barrier()

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t0)

    # one Checkpointer for the whole run, as in training (its background group is made once);
    # keep: every step stays, so retention deletes nothing inside a timed save
    ckpt = ckptkit.Checkpointer(os.path.join(args.work, "ck"), keep=args.repeat + 1, async_save=True)
    _warm_up(os.path.join(args.work, "warm"), ckpt)
    times: dict[str, dict[str, list[float]]] = {op: {"ckptkit": [], "torch": []} for op, _, _ in OPS}
    equal_ok = {"ckptkit restore": True, "torch restore": True, "ckptkit.load": True, "dcp.load": True}

    def ck_round(i: int) -> None:
        drop()
        t0 = time.perf_counter()
        ckpt.save(i + 1, model, optim)
        blocked = time.perf_counter() - t0
        ckpt.wait()
        durable = time.perf_counter() - t0
        times[OPS[0][0]]["ckptkit"].append(slowest(blocked))
        times[OPS[1][0]]["ckptkit"].append(slowest(durable))
        scramble()
        drop()
        times["restore"]["ckptkit"].append(timed(lambda: ckpt.restore(model, optim)))  # the newest: step i + 1
        equal_ok["ckptkit restore"] &= equal()
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        path = os.path.join(args.work, f"cks_{i}")
        drop()
        times["save"]["ckptkit"].append(timed(lambda: ckptkit.save(state, path)))
        scramble()
        drop()
        times["load"]["ckptkit"].append(timed(lambda: ckptkit.load(state, path)))
        equal_ok["ckptkit.load"] &= equal()

    def torch_round(i: int) -> None:
        folder = os.path.join(args.work, f"dcp_async_{i}")
        drop()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, optim)
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=folder)
        blocked = time.perf_counter() - t0
        future.result()
        durable = time.perf_counter() - t0
        times[OPS[0][0]]["torch"].append(slowest(blocked))
        times[OPS[1][0]]["torch"].append(slowest(durable))
        scramble()
        drop()

        def restore() -> None:
            msd, osd = get_state_dict(model, optim)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=folder)
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)

        times["restore"]["torch"].append(timed(restore))
        equal_ok["torch restore"] &= equal()
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        path = os.path.join(args.work, f"dcps_{i}")
        drop()
        times["save"]["torch"].append(timed(lambda: dcp.save(state, checkpoint_id=path)))
        scramble()
        drop()
        times["load"]["torch"].append(timed(lambda: dcp.load(state, checkpoint_id=path)))
        equal_ok["dcp.load"] &= equal()

    for i in range(args.repeat):
        rounds = (torch_round, ck_round) if i % 2 == 0 else (ck_round, torch_round)
        for fn in rounds:
            fn(i)
        dist.barrier()
        if rank == 0:  # keep the disk from filling at large sizes
            for name in os.listdir(args.work):
                if name.endswith(f"_{i}"):
                    shutil.rmtree(os.path.join(args.work, name), ignore_errors=True)
            os.sync()  # the deletion's own writes, done before the next repeat's first tool starts
            time.sleep(2)  # (and the filesystem's deferred freeing of the blocks settled)
        if rank == 0:
            print(f"repeat {i + 1}/{args.repeat}: " + ", ".join(
                f"{op.split(' ')[0]} ck {t['ckptkit'][-1]:.2f} / torch {t['torch'][-1]:.2f}"
                for op, t in times.items()), flush=True)
    if rank == 0:
        res = {"machine": machine_line(), "cold": cold, "repeat": args.repeat, "gb": total.item() / 1e9,
               "layers": LAYERS, "width": width, "raw": times, "equal": equal_ok,
               "times": {op: {k: statistics.median(v) for k, v in t.items()} for op, t in times.items()}}
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _build(layers: int, width: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _tensors(obj) -> list:
    """Every tensor of a state dict (DTensors: their local shards), in a fixed order."""
    import torch

    out = []
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            out += _tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += _tensors(v)
    elif isinstance(obj, torch.Tensor):
        out.append(obj.to_local() if hasattr(obj, "to_local") else obj)
    return out


def _warm_up(folder: str, ckpt) -> None:
    """One small untimed save and load with each tool: imports and first-call setup are paid here
    (`ckpt`, the run's Checkpointer, saves a small model as step 0)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckptkit

    model, optim = _build(2, 64)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    ckpt.save(0, model, optim)
    ckpt.wait()
    ckpt.restore(model, optim)
    dcp.async_save(state, checkpoint_id=os.path.join(folder, "dcp")).result()
    dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    ckptkit.save(state, os.path.join(folder, "cks"))
    ckptkit.load(state, os.path.join(folder, "cks"))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
