"""The Checkpointer's user-facing promises in a real 2-rank job (launched by
tests/hooks/test_checkpointer_states.py):

    torchrun --nproc_per_node 2 tests/dist/checkpointer_states_job.py --dir DIR --result R.json

FSDP2 ToyModel + AdamW + StepLR + a per-rank stateful object (each rank's own position), each
rank seeded apart. Save at step 3 with `states` and `extra` holding tensors; note each rank's
next random draws; train on and reseed (the crash); restore into a fresh model: each rank's
draws, its own stateful object, the scheduler, `extra`'s tensors and the full model/optimizer
state (bit for bit) must be what they were at step 3, and `latest` names step 3. With --one, a
step saved by one process is restored at 2 ranks: both ranks get its states, the generators
stay as they are, rank 0 warns. Then, on every rank: a second save of step 3 is refused, an
older step saved with keep=1 stays, restore(step=2) takes it, and nothing warns.
Rank 0 writes the JSON result, with every rank's problems gathered.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import models  # noqa: E402
from _checks import compare_one, run_and_leave, start_watchdog  # noqa: E402
from checkpointer_job import build, compare, full_state  # noqa: E402

from ckptkit import Checkpointer  # noqa: E402


class Position:
    def __init__(self, value: int) -> None:
        self.value = value
        self.seen = torch.tensor([value, value + 1])

    def state_dict(self) -> dict:
        return {"value": self.value, "seen": self.seen.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.value, self.seen = sd["value"], sd["seen"]


def seed_all(n: int) -> None:
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)


def draws() -> list:
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist()]


def body(args) -> dict:
    rank = dist.get_rank()
    problems: list[str] = []
    model, optim = build(models.MODEL_SEED)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    position = Position(100 * (rank + 1))
    for step in range(1, 4):
        models.train_steps(model, optim, 1, models.DATA_SEED + step)
        sched.step()
        position.value += 1
    seed_all(1000 + rank)
    extra = {"ema": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7, "epoch": 1}
    ckpt = Checkpointer(args.dir)
    ckpt.save(3, model, optim, extra=extra, states={"sched": sched, "pos": position})
    want_state, want_sched, want_pos = full_state(model, optim), sched.state_dict(), position.state_dict()
    want_draws = draws()
    models.train_steps(model, optim, 2, models.DATA_SEED + 10)   # training goes on, then the crash
    seed_all(7)

    fresh, fresh_optim = build(models.MODEL_SEED + 9)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_optim, step_size=2, gamma=0.5)
    fresh_pos = Position(-1)
    again = Checkpointer(args.dir)
    step = again.restore(fresh, fresh_optim, states={"sched": fresh_sched, "pos": fresh_pos})
    got_draws = draws()
    if step != 3:
        problems.append(f"rank {rank}: restore returned {step}")
    if got_draws != want_draws:
        problems.append(f"rank {rank}: draws after restore {got_draws} != {want_draws}")
    if fresh_sched.state_dict() != want_sched:
        problems.append(f"rank {rank}: scheduler {fresh_sched.state_dict()} != {want_sched}")
    if fresh_pos.value != want_pos["value"] or compare_one("seen", fresh_pos.seen, want_pos["seen"]):
        problems.append(f"rank {rank}: position {fresh_pos.state_dict()} != {want_pos}")
    got_extra = again.extra or {}
    if got_extra.get("epoch") != 1 or compare_one("ema", got_extra.get("ema"), extra["ema"]):
        problems.append(f"rank {rank}: extra {got_extra!r}")
    got_state = full_state(fresh, fresh_optim)
    compared = len(want_state)
    problems += [f"rank {rank}: {p}" for p in compare(got_state, want_state)]
    problems += misuse(args.dir, rank, fresh, fresh_optim)
    if args.one:  # saved by one process: rank 1 did not exist there
        problems += at_another_world_size(args.one, rank)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"problems": problems, "draws": want_draws})
    all_problems = [p for e in everyone for p in e["problems"]]
    latest = Path(args.dir, "latest").read_text()
    rng_files = sorted(os.listdir(Path(args.dir, "step_000000003", "rng")))
    return {"ok": not all_problems, "mismatches": all_problems, "step": step, "compared": compared,
            "world_size": dist.get_world_size(), "latest": latest, "rng_files": rng_files,
            "draws_differ_between_ranks": everyone[0]["draws"] != everyone[1]["draws"]}


def misuse(directory: str, rank: int, model, optim) -> list[str]:
    """On every rank: saving step 3 again is refused without overwrite; an older step saved
    with keep=1 is kept (the step just written) and the pointer still names step 3; restore(step=2)
    takes it; nothing warns."""
    import warnings

    from ckptkit.errors import OutputError

    problems = []
    ckpt = Checkpointer(directory, keep=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            ckpt.save(3, model, optim)
            problems.append(f"rank {rank}: saving step 3 again was not refused")
        except OutputError as exc:  # on every rank, and the Checkpointer stays usable
            if "already saved" not in str(exc):
                problems.append(f"rank {rank}: refusal {exc}")
        ckpt.save(2, model, optim, states={"pos": Position(2)})
        if ckpt.steps() != [2, 3]:
            problems.append(f"rank {rank}: keep=1 after saving step 2 left {ckpt.steps()}")
        latest = Path(directory, "latest").read_text()
        if latest != "step_000000003\n":
            problems.append(f"rank {rank}: latest is {latest!r} after saving an older step")
        position = Position(-1)
        step = Checkpointer(directory).restore(model, optim, states={"pos": position}, step=2)
        if step != 2 or position.value != 2:
            problems.append(f"rank {rank}: restore(step=2) gave {step}, position {position.value}")
    problems += [f"rank {rank}: warned {w.category.__name__}: {w.message}" for w in seen]
    return problems


def at_another_world_size(directory: str, rank: int) -> list[str]:
    """A step saved by one process, restored at 2 ranks: both ranks get rank 0's states; no
    rank's generators are touched, and rank 0 alone says so in an RngNotRestoredWarning."""
    import warnings

    from ckptkit.hooks.rng import RngNotRestoredWarning

    problems = []
    fresh, fresh_optim = build(models.MODEL_SEED + 4)
    position = Position(-5)
    seed_all(50 + rank)
    want_draws = draws()
    seed_all(50 + rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = Checkpointer(directory).restore(fresh, fresh_optim, states={"pos": position})
    rng_warnings = [w for w in seen if issubclass(w.category, RngNotRestoredWarning)]
    if step != 1 or position.value != 42:
        problems.append(f"rank {rank}: one-process step: restore gave step {step}, position {position.value}")
    if draws() != want_draws:
        problems.append(f"rank {rank}: the generators changed at another world size")
    wanted = 1 if rank == 0 else 0
    if len(rng_warnings) != wanted or (wanted and "world size 1, this run has 2" not in str(rng_warnings[0].message)):
        problems.append(f"rank {rank}: RNG warnings {[str(w.message) for w in rng_warnings]}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--one", default="", help="a Checkpointer folder saved by one process (step 1, pos 42)")
    ap.add_argument("--deadline", type=float, default=240)
    args = ap.parse_args()
    start_watchdog(args.deadline)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    run_and_leave(dist.get_rank(), args.result, lambda: body(args))


if __name__ == "__main__":
    main()
