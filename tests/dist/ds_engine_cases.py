"""Several DeepSpeed engine checks in one launch: DeepSpeed's start-up (imports, process group, its
ops) costs most of a small check's time on CPU, so every check at one world size shares it.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W tests/dist/ds_engine_cases.py \
        --cases CASES.json --result OUT.json

CASES is a list of {"id", "check", "argv"}: "check" a check script next to this one
(ds_load_check, ds_tp_load_check, ds_moe_load_check), "argv" its options (without --result).
Every rank runs the cases in order through the script's check_case(argv, rank, world), each
building its own model and engine after DeepSpeed's module-level groups are forgotten; a case
that raises is reported with its error and the next one runs. Rank 0 writes {"world_size", "results": {id: the script's result}}; the exit status is 0
when every case ran (the verdicts are in the result). Never hangs:
process-group timeout, a watchdog over the whole launch, os._exit.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from _checks import leave, start_watchdog, write_result  # noqa: E402  (tests/dist, next to this script)


def forget_groups() -> None:
    """DeepSpeed keeps the groups an engine made in module globals (the expert groups by name,
    "ep_size_E", and a model-parallel unit) and hands them to the engines after it: each case
    starts with none, as in a process of its own."""
    from deepspeed.utils import groups

    for made in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                 groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
                 groups._ALL_TO_ALL_GROUP):  # fmt: skip
        made.clear()
    groups.mpu = None
    groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = groups._DATA_PARALLEL_GROUP = None
    groups._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = groups._MPU_TENSOR_MODEL_PARALLEL_RANK = None


def run_case(case: dict, result_path: str, rank: int, world: int) -> dict:
    """One case's result; what it raises becomes {"ok": False, "error", "traceback"}."""
    forget_groups()
    try:
        module = importlib.import_module(case["check"])
        return module.check_case([*case["argv"], "--result", result_path], rank, world)
    except BaseException as exc:  # report this one, go on with the next
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
        print(f"{case['id']}: {error}", file=sys.stderr, flush=True)
        return {"ok": False, "world_size": world, "compared": 0, "mismatches": [], "trained_step": False,
                "error": error, "traceback": traceback.format_exc()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--pg-timeout", type=float, default=120.0)
    ap.add_argument("--deadline", type=float, default=1200.0, help="kill this process after so many seconds")
    args = ap.parse_args()
    start_watchdog(args.deadline)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = json.loads(Path(args.cases).read_text())
    results = {}
    for case in cases:
        results[case["id"]] = run_case(case, args.result, rank, world)
        if rank == 0:
            res = results[case["id"]]
            print(json.dumps({"id": case["id"], **{k: res.get(k) for k in ("ok", "compared", "error")}}), flush=True)
    if rank == 0:
        write_result(args.result, {"world_size": world, "results": results})
    leave(0)  # the verdicts are in the result (only rank 0 holds them whole)


if __name__ == "__main__":
    main()
