"""A real FSDP2 training job using ckptkit.Checkpointer (launched by tests/test_checkpointer.py).

    torchrun --nproc_per_node W tests/dist/checkpointer_job.py --phase PHASE --dir DIR --result R.json

phase "save" (3 ranks): trains fixtures/models.py's ToyModel with FSDP2 + AdamW; saves at steps
2 and 4 (synchronously); writes the full state (get_state_dict full_state_dict=True, flattened
like DCP) of steps 4 and 6 to DIR/../truth_<step>.pt; async-saves at step 6 and every rank
SIGKILLs itself at once.
phase "resume" (any size): a fresh model from another seed; Checkpointer.restore returns the
newest complete step; the full model and optimizer state must equal truth_<step>.pt bit for bit
and `extra` must be what was saved; then one more training step.
phase "async" (any size): async save at step 1, then training goes on (parameters change) before
wait(); restoring into a fresh model gives step 1's values. Then retention: keep=2 with saves at
steps 1..4 leaves exactly steps 3 and 4.
Rank 0 writes the JSON result. Exit 0 when the check ran (verdict in the JSON).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import models  # noqa: E402
from _checks import compare_one, run_and_leave, start_watchdog  # noqa: E402

from ckptkit import Checkpointer  # noqa: E402


def build(seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    model = models.make_model(seed)
    models.shard_fsdp2(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, models.make_optimizer(model)


def full_state(model, optim) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat, _ = flatten_state_dict({"model": msd, "optim": osd})
    # full_state_dict hands back the live tensors of unsharded entries (AdamW's step): copy them
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in flat.items()}


def compare(got: dict, want: dict) -> list[str]:
    problems = [f"{k}: missing" for k in sorted(set(want) - set(got))]
    problems += [p for k in sorted(set(want) & set(got)) if (p := compare_one(k, got[k], want[k]))]
    return problems


def phase_save(args) -> dict:
    model, optim = build(models.MODEL_SEED)
    sync = Checkpointer(args.dir, keep=3)
    background = Checkpointer(args.dir, keep=3, async_save=True)
    truth_dir = Path(args.dir).parent
    for step in range(1, 7):
        models.train_steps(model, optim, 1, models.DATA_SEED + step)
        if step in (4, 6):
            state = full_state(model, optim)
            if dist.get_rank() == 0:
                torch.save(state, truth_dir / f"truth_{step}.pt")
        if step in (2, 4):
            sync.save(step, model, optim, extra={"note": f"step {step}", "epoch": step // 2})
        if step == 6:
            background.save(step, model, optim, extra={"note": "step 6", "epoch": 3})
            os.kill(os.getpid(), signal.SIGKILL)  # at once, while the write may still be running
    return {"ok": False, "error": "not killed"}


def phase_resume(args) -> dict:
    model, optim = build(models.MODEL_SEED + 7)
    ckpt = Checkpointer(args.dir, keep=3)
    step = ckpt.restore(model, optim)
    got = full_state(model, optim)
    problems: list[str] = []
    compared = 0
    if dist.get_rank() == 0:
        if step is None:
            problems.append("restore found nothing")
        else:
            want = torch.load(Path(args.dir).parent / f"truth_{step}.pt", weights_only=True)
            compared = len(want)
            problems += compare(got, want)
            want_extra = {"note": f"step {step}", "epoch": step // 2}
            if ckpt.extra != want_extra:
                problems.append(f"extra {ckpt.extra!r} != {want_extra!r}")
    losses = models.train_steps(model, optim, 1, models.DATA_SEED)
    leftovers = sorted(n for n in os.listdir(args.dir) if n.startswith("."))
    return {"ok": not problems and step in (4, 6) and not leftovers and compared >= 60, "step": step,
            "compared": compared, "mismatches": problems,
            "loss_after": losses[0], "leftovers": leftovers, "steps_on_disk": ckpt.steps(),
            "world_size": dist.get_world_size()}


def phase_async(args) -> dict:
    problems: list[str] = []
    model, optim = build(models.MODEL_SEED)
    models.train_steps(model, optim, 1, models.DATA_SEED)
    truth = full_state(model, optim)
    ckpt = Checkpointer(os.path.join(args.dir, "async"), keep=3, async_save=True)
    ckpt.save(1, model, optim, extra={"epoch": 1})
    models.train_steps(model, optim, 3, models.DATA_SEED + 1)  # training goes on during the write
    changed = full_state(model, optim)
    ckpt.wait()
    fresh, fresh_optim = build(models.MODEL_SEED + 3)
    step = Checkpointer(os.path.join(args.dir, "async")).restore(fresh, fresh_optim)
    got = full_state(fresh, fresh_optim)
    if dist.get_rank() == 0:
        if step != 1:
            problems.append(f"restore returned {step}")
        problems += compare(got, truth)
        if not compare(changed, truth):
            problems.append("training after the async save did not change the state (the check proves nothing)")
    keep = Checkpointer(os.path.join(args.dir, "keep"), keep=2)
    for step in range(1, 5):
        models.train_steps(model, optim, 1, models.DATA_SEED)
        keep.save(step, model, optim)
    kept = keep.steps()
    if kept != [3, 4]:
        problems.append(f"keep=2 left steps {kept}")
    return {"ok": not problems, "mismatches": problems, "kept": kept, "world_size": dist.get_world_size()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "resume", "async"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--deadline", type=float, default=300)
    args = ap.parse_args()
    start_watchdog(args.deadline)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    phase = {"save": phase_save, "resume": phase_resume, "async": phase_async}[args.phase]
    run_and_leave(dist.get_rank(), args.result, lambda: phase(args))

if __name__ == "__main__":
    main()
