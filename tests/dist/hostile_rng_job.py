"""A 2-rank job (launched by tests/test_hostile_hooks.py): rank 1's RNG file of step 1 is no
generator state. restore() must refuse it on both ranks at the same call, naming rank 1's file,
with every rank's model and generators unchanged; the Checkpointer stays usable (save(2) and
restore() of step 2 work). Rank 0 writes the JSON result, with every rank's problems gathered.

    torchrun --nproc_per_node 2 tests/dist/hostile_rng_job.py --dir DIR --result R.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _checks import run_and_leave, start_watchdog  # noqa: E402
from ckptkit import Checkpointer  # noqa: E402
from ckptkit.errors import FormatError  # noqa: E402
from ckptkit.hooks import rng as rng_files  # noqa: E402


def body(args: argparse.Namespace) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 4)
    ck = Checkpointer(args.dir)
    ck.save(1, model)
    step_dir = Path(ck.path(1))
    if rank == 0:
        path = step_dir / rng_files.file_name(1)
        doc = json.loads(path.read_text())
        doc["torch"] = "00"
        path.write_text(json.dumps(doc))
        (step_dir / ".ckptkit-complete").unlink()  # unmarked steps are still read
    dist.barrier()
    problems = []
    with torch.no_grad():
        model.weight.add_(1.0)
    weights = model.weight.detach().clone()
    before = (random.getstate(), torch.get_rng_state())
    try:
        ck.restore(model)
        problems.append("restore did not refuse")
    except FormatError as exc:
        if "rank_00001.json" not in str(exc):
            problems.append(f"the refusal does not name rank 1's file: {exc}")
    if not torch.equal(model.weight.detach(), weights):
        problems.append("the model was loaded before the refusal")
    if random.getstate() != before[0] or not torch.equal(torch.get_rng_state(), before[1]):
        problems.append("a generator changed")
    ck.save(2, model)  # still usable: no collective marked failed
    if ck.restore(model) != 2:
        problems.append("restore after the refusal did not take step 2")
    gathered: list = [None, None]
    dist.all_gather_object(gathered, problems)
    return {"ok": not any(gathered), "problems": gathered}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--deadline", type=float, default=240)
    args = ap.parse_args()
    start_watchdog(args.deadline)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    run_and_leave(dist.get_rank(), args.result, lambda: body(args))


if __name__ == "__main__":
    main()
