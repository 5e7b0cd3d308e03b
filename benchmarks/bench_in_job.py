"""Benchmark (CPU): a training step's wait for its checkpoint, ckptkit against torch.distributed.checkpoint.

    python benchmarks/bench_in_job.py [--size-mb 1200] [--repeat 5] [--batch 8] [--save-load] [--work DIR]

Launches itself under torchrun on 2 ranks (gloo). Each rank builds a stack of Linear layers with
about --size-mb MB of state in total (fp32 parameters + AdamW's exp_avg and exp_avg_sq, over both
ranks), shards it with FSDP2 (fully_shard) and takes one AdamW step. Then, in the same run,
--repeat times each (median and spread reported, the order of the two tools alternating between
repeats), a training step with a save in it:

    save(step) -> forward + backward of --batch rows -> optimizer.step() -> wait until durable

  returns   Checkpointer(async_save=True).save     vs  get_state_dict + dcp.async_save (its default
            stager and thread; a gloo process group of its own, made once, as the Checkpointer has:
            on the default group its writer's collectives would meet FSDP2's and gloo aborts the
            job): until the call returns
  waits     what optimizer.step() then waits for ckptkit's copy of the optimizer's tensors (timed
            as Checkpointer.wait_staged() just before it; dcp.async_save copied before returning: 0)
  stall     returns + waits: what the training loop lost to the save
  durable   from the call until Checkpointer.wait() / the future's .result() returned, in a
            watcher thread started when the call returned (the step goes on meanwhile)
  restore   Checkpointer.restore                   vs  get_state_dict + dcp.load + set_state_dict
and with --save-load also ckptkit.save vs dcp.save and ckptkit.load vs dcp.load. One Checkpointer
serves the whole run, as in training: its background group is made once and its staging
buffers are allocated by an untimed save of the same model first (dcp.async_save, which allocates
every time, gets an untimed save too); keep is high enough that retention deletes nothing inside a
timed save; restore takes the step just saved, which puts back the state of the call, so every
repeat starts from the same state. Times are the slowest rank's (a barrier before each call;
each rank times its own call). The page cache is synced before every timed save and restore, and
dropped too when run as root. After every restore (and load) the model and optimizer state (each
rank's shards) must equal the state at the save's call bit for bit (torch.equal), for both tools;
the state is scrambled before each so a load that does nothing cannot pass. Prints a Markdown
table (median, min-max, the ratio of the medians ckptkit / torch), the machine line and the date;
exits 1 when a check failed.
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
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LAYERS = 16
OPS = [
    ("returns", "Checkpointer(async_save=True).save", "dcp.async_save"),
    ("waits at optimizer.step", "copy of the optimizer's tensors", "-"),
    ("stall (returns + waits)", "", ""),
    ("durable", "Checkpointer.wait()", "dcp.async_save future .result()"),
    ("restore", "Checkpointer.restore", "dcp.load + set_state_dict"),
    ("forward + backward (info)", "during the save", "during the save"),
]
SAVE_LOAD = [("save", "ckptkit.save", "dcp.save"), ("load", "ckptkit.load", "dcp.load")]
GOALS = {"stall (returns + waits)": 0.5, "durable": 1.0, "restore": 1.0}


# ---- the launcher --------------------------------------------------------------------------

def measure(size_mb: int, repeat: int, work: str, batch: int = 8, save_load: bool = False, device: str = "cpu",
            nproc: int = 2) -> dict:
    """Run the 2-rank job in a fresh folder under `work` (removed afterwards) and return its results."""
    import tempfile

    os.makedirs(work, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="in_job-", dir=work)  # removed whole afterwards
    result = os.path.join(scratch, "in_job.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), os.path.abspath(__file__),
           "--worker", "--size-mb", str(size_mb), "--repeat", str(repeat), "--batch", str(batch),
           "--work", scratch, "--json", result, "--device", device] + (["--save-load"] if save_load else [])
    try:
        subprocess.run(cmd, check=True, env=env)
        with open(result) as f:
            return json.load(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def print_result(res: dict) -> None:
    print(f"\n### A training step with a save: {res['gb']:.2f} GB of state (FSDP2 + AdamW, {res['world']} ranks, "
          f"{res['device']}), median (min-max) of {res['repeat']}\n")
    print(f"{res['machine']}; forward + backward of {res['batch']} rows between the save and the step; "
          f"page cache dropped before every timed call: {'yes' if res['cold'] else 'no (not root)'}\n")
    print("| operation | ckptkit | torch | ckptkit (s) | torch (s) | ckptkit / torch | goal |\n"
          "|---|---|---|---:|---:|---:|---|")
    for op, ck_tool, torch_tool in OPS + (SAVE_LOAD if "save" in res["raw"] else []):
        ck, th = res["raw"][op]["ckptkit"], res["raw"][op]["torch"]
        mc, mt = statistics.median(ck), statistics.median(th)
        ratio = f"{mc / mt:.2f}x" if mt >= 0.001 else "-"  # (torch's wait at the step is nil)
        goal = GOALS.get(op)
        verdict = "" if goal is None or mt < 0.001 else f"<= {goal}x: {'met' if mc / mt <= goal else 'MISSED'}"
        print(f"| {op} | {ck_tool} | {torch_tool} | {_cell(ck)} | {_cell(th)} | {ratio} | {verdict} |")
    print(f"\n- restored and loaded state equal to the saved state bit for bit: {res['equal']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1200, help="MB of state over both ranks (params + 2 Adam moments)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="rows of the forward + backward between save and step")
    ap.add_argument("--save-load", action="store_true", help="also ckptkit.save/load vs dcp.save/load")
    ap.add_argument("--work", default="/tmp/ckptkit-bench-injob")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    res = measure(args.size_mb, args.repeat, args.work, args.batch, args.save_load)
    print_result(res)
    if not all(res["equal"].values()):
        raise SystemExit("a restored or loaded state differs from the saved one")


# ---- the job (every rank) ------------------------------------------------------------------

class Job:
    """One rank's model, optimizer, the state saved, and the collective timing helpers."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.args, self.torch, self.dist = args, torch, dist
        self.rank = dist.get_rank()
        params = args.size_mb * 1e6 / 12  # fp32 weights + exp_avg + exp_avg_sq
        self.width = max(64, int(math.sqrt(params / LAYERS)) // 64 * 64)
        self.device = args.device
        self.model, self.optim = _build(LAYERS, self.width, self.device)
        self.cold = os.geteuid() == 0
        self.want = [t.clone() for t in self.local_state()]
        total = torch.tensor([float(sum(t.numel() * t.element_size() for t in self.want))])
        dist.all_reduce(total)
        self.gb = total.item() / 1e9
        self.torch_pg = dist.new_group(backend="gloo")  # dcp.async_save's background group, made once
        rows = torch.randn(args.batch, self.width, generator=torch.Generator().manual_seed(self.rank))
        self.batch = rows.to(self.device)

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def local_state(self) -> list:
        return _tensors(self.state())

    def scramble(self) -> None:
        with self.torch.no_grad():
            for t in self.local_state():
                t.fill_(7)
        if any(self.torch.equal(a, b) for a, b in zip(self.local_state(), self.want)):
            raise SystemExit("scrambling did not reach the model's and optimizer's own tensors")

    def equal(self) -> bool:
        ok = self.torch.tensor([float(all(self.torch.equal(a, b) for a, b in zip(self.local_state(), self.want)))])
        self.dist.all_reduce(ok, op=self.dist.ReduceOp.MIN)
        return bool(ok.item())

    def slowest(self, seconds: float) -> float:
        t = self.torch.tensor([seconds])
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.item()

    def drop(self) -> None:
        """Every timed call starts alike: nothing left to write back, and (as root) a cold cache."""
        if self.rank == 0:
            os.sync()
            if self.cold:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("1\n")
        self.dist.barrier()

    def sync(self) -> None:
        """A GPU's queued kernels finished (a call is timed until its work is done)."""
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def timed(self, fn) -> float:
        self.sync()
        self.dist.barrier()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return self.slowest(time.perf_counter() - t0)

    def training_step(self, save, before_step, durable) -> dict:
        """save() -> forward + backward -> before_step() -> optimizer.step(), while a watcher
        thread waits in durable() for the save to be on disk; the seconds of each part (the
        slowest rank's), from one barrier."""
        self.sync()
        self.drop()
        t0 = time.perf_counter()
        save()
        t1 = time.perf_counter()
        done: list = []

        def watch() -> None:
            try:
                durable()
            finally:
                done.append(time.perf_counter())

        watcher = threading.Thread(target=watch, name="bench-durable")
        watcher.start()
        self.model(self.batch).square().mean().backward()
        self.sync()
        t2 = time.perf_counter()
        before_step()
        t3 = time.perf_counter()
        self.optim.step()
        self.optim.zero_grad()
        self.sync()
        watcher.join()
        return {"returns": self.slowest(t1 - t0), "fwd_bwd": self.slowest(t2 - t1),
                "waits": self.slowest(t3 - t2), "durable": self.slowest(done[0] - t0)}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from _measure import machine_line

    if args.device == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    job = Job(args)
    ops = OPS + (SAVE_LOAD if args.save_load else [])
    times: dict[str, dict[str, list[float]]] = {op: {"ckptkit": [], "torch": []} for op, _, _ in ops}
    equal_ok = {"ckptkit restore": True, "torch restore": True}
    if args.save_load:
        equal_ok.update({"ckptkit.load": True, "dcp.load": True})
    ckpt = _warm_up(job)
    rounds = {"ckptkit": lambda i: _ck_round(job, ckpt, i, times, equal_ok),
              "torch": lambda i: _torch_round(job, i, times, equal_ok)}
    for i in range(args.repeat):
        for tool in (("torch", "ckptkit") if i % 2 == 0 else ("ckptkit", "torch")):
            rounds[tool](i)
        dist.barrier()
        if job.rank == 0:  # keep the disk from filling at large sizes
            for name in os.listdir(args.work):
                if name.endswith(f"_{i}"):
                    shutil.rmtree(os.path.join(args.work, name), ignore_errors=True)
            os.sync()  # the deletion's own writes, done before the next repeat's first tool starts
            time.sleep(2)  # (and the filesystem's deferred freeing of the blocks settled)
            print(f"repeat {i + 1}/{args.repeat}: " + ", ".join(
                f"{op.split(' ')[0]} ck {t['ckptkit'][-1]:.3f} / torch {t['torch'][-1]:.3f}"
                for op, t in times.items()), flush=True)
    if job.rank == 0:
        res = {"machine": machine_line(), "device": _device_line(job), "world": dist.get_world_size(), "cold": job.cold, "repeat": args.repeat, "gb": job.gb,
               "layers": LAYERS, "width": job.width, "batch": args.batch, "raw": times, "equal": equal_ok,
               "times": {op: {k: statistics.median(v) for k, v in t.items()} for op, t in times.items()}}
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _record(times: dict, tool: str, step: dict) -> None:
    times[OPS[0][0]][tool].append(step["returns"])
    times[OPS[1][0]][tool].append(step["waits"])
    times[OPS[2][0]][tool].append(step["returns"] + step["waits"])
    times[OPS[3][0]][tool].append(step["durable"])
    times[OPS[5][0]][tool].append(step["fwd_bwd"])


def _ck_round(job: Job, ckpt, i: int, times: dict, equal_ok: dict) -> None:
    import ckptkit

    step = job.training_step(lambda: ckpt.save(i + 1, job.model, job.optim), ckpt.wait_staged, ckpt.wait)
    _record(times, "ckptkit", step)
    job.scramble()
    job.drop()
    times["restore"]["ckptkit"].append(job.timed(lambda: ckpt.restore(job.model, job.optim)))  # step i + 1
    equal_ok["ckptkit restore"] &= job.equal()
    if "save" in times:
        state = job.state()
        path = os.path.join(job.args.work, f"cks_{i}")
        job.drop()
        times["save"]["ckptkit"].append(job.timed(lambda: ckptkit.save(state, path)))
        job.scramble()
        job.drop()
        times["load"]["ckptkit"].append(job.timed(lambda: ckptkit.load(state, path)))
        equal_ok["ckptkit.load"] &= job.equal()


def _torch_round(job: Job, i: int, times: dict, equal_ok: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    folder = os.path.join(job.args.work, f"dcp_async_{i}")
    future = []
    pg = job.torch_pg  # as the Checkpointer's: the write's collectives never meet training's

    def save() -> None:
        future.append(dcp.async_save(job.state(), checkpoint_id=folder, process_group=pg))

    step = job.training_step(save, lambda: None, lambda: future[0].result())
    _record(times, "torch", step)
    job.scramble()
    job.drop()

    def restore() -> None:
        state = job.state()
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(job.model, job.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    times["restore"]["torch"].append(job.timed(restore))
    equal_ok["torch restore"] &= job.equal()
    if "save" in times:
        state = job.state()
        path = os.path.join(job.args.work, f"dcps_{i}")
        job.drop()
        times["save"]["torch"].append(job.timed(lambda: dcp.save(state, checkpoint_id=path)))
        job.scramble()
        job.drop()
        times["load"]["torch"].append(job.timed(lambda: dcp.load(state, checkpoint_id=path)))
        equal_ok["dcp.load"] &= job.equal()


def _build(layers: int, width: int, device: str = "cpu"):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width, device=device)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _device_line(job: Job) -> str:
    if job.device == "cuda":
        return f"{job.torch.cuda.get_device_name()}, nccl + gloo, staging into pinned memory"
    return "CPU, gloo"


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


def _warm_up(job: Job):
    """Untimed: the run's Checkpointer (its background group made once, keep high enough that no
    retention runs inside a timed save) saves and restores the model once, so its staging buffers
    exist, as after a training run's first checkpoint; dcp.async_save and dcp.load run once too,
    and with --save-load ckptkit.save/load: imports and first-call setup are paid here. Restoring
    puts back the state every repeat starts from."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    import ckptkit

    folder = os.path.join(job.args.work, "warm")
    ckpt = ckptkit.Checkpointer(os.path.join(job.args.work, "ck"), keep=job.args.repeat + 2, async_save=True)
    ckpt.save(0, job.model, job.optim)
    ckpt.wait()
    ckpt.restore(job.model, job.optim)
    state = job.state()
    dcp.async_save(state, checkpoint_id=os.path.join(folder, "dcp"), process_group=job.torch_pg).result()
    dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))
    set_state_dict(job.model, job.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if job.args.save_load:
        ckptkit.save(state, os.path.join(folder, "cks"))
        ckptkit.load(state, os.path.join(folder, "cks"))
    dist.barrier()
    if not job.equal():
        raise SystemExit("the warm-up's restore changed the state")
    if job.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return ckpt


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
