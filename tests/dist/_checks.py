"""Helpers shared by the multi-process load checks: bit-exact comparison and result files."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def write_result(path: str, result: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True, default=repr) + "\n")
    os.replace(tmp, p)


def describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"Tensor(dtype={v.dtype}, shape={tuple(v.shape)})"
    return repr(v)


def compare_one(key: str, got, want) -> str | None:
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
            return f"{key}: type got {describe(got)} want {describe(want)}"
        if got.dtype != want.dtype:
            return f"{key}: dtype got {got.dtype} want {want.dtype}"
        if tuple(got.shape) != tuple(want.shape):
            return f"{key}: shape got {tuple(got.shape)} want {tuple(want.shape)}"
        if not torch.equal(got, want):
            n_diff = int((got != want).sum())
            detail = ""
            if got.is_floating_point():
                detail = f", max abs diff {float((got.double() - want.double()).abs().max()):.3g}"
            return f"{key}: values differ in {n_diff}/{want.numel()} elements{detail}"
        return None
    if type(got) is not type(want) or got != want:
        return f"{key}: got {got!r} want {want!r}"
    return None


def start_watchdog(seconds: float) -> None:
    """Kill this process (status 124) after `seconds`, whatever it is waiting for."""
    import threading

    timer = threading.Timer(seconds, lambda: os._exit(124))
    timer.daemon = True
    timer.start()


def leave(code: int) -> None:
    """Final barrier only on success (a failed rank must not hang the others), then os._exit."""
    import sys

    import torch.distributed as dist

    if code == 0:
        try:
            dist.barrier()
        except Exception:
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_and_leave(rank: int, result_path: str, body) -> None:
    """Run `body()` (returns the result dict); an exception becomes {"ok": False, "error", ...};
    rank 0 writes the result; leave with a final barrier only on success (a failed rank must not
    hang the others), then os._exit."""
    import sys
    import traceback

    code = 0
    try:
        result = body()
    except BaseException as e:  # report, then leave without hanging
        code = 1
        result = {"ok": False, "error": f"rank {rank}: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(result["error"], file=sys.stderr, flush=True)
    if rank == 0:
        write_result(result_path, result)
    leave(code)


def join_verdicts(result: dict, world: int, compared: int, mismatches: list, trained: bool) -> dict:
    """Every rank's (values compared, mismatches, trained a step) gathered; on rank 0 `result`
    completed with the totals and the verdict (the other ranks return it as it was)."""
    import torch.distributed as dist

    gathered: list = [None] * world
    dist.all_gather_object(gathered, (compared, mismatches, trained))
    if dist.get_rank() == 0:
        result["compared"] = sum(c for c, _, _ in gathered)
        result["mismatches"] = [x for _, ms, _ in gathered for x in ms][:50]
        result["trained_step"] = all(t for _, _, t in gathered)
        result["ok"] = not result["mismatches"] and result["trained_step"] and result["compared"] > 0
    return result


def load_with_states(engine, ckpt: str) -> None:
    """`engine.load_checkpoint(ckpt)` with optimizer and scheduler states, refusing to go on when it
    found nothing; then ZeRO's hp-param links to the optimizer state rebuilt, so that
    `safe_get_full_optimizer_state` reads the loaded state, not what the engine held before."""
    path, _ = engine.load_checkpoint(ckpt, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"load_checkpoint found nothing in {ckpt}")
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def run_check(run, parse_args, pg_timeout: float = 120.0) -> None:
    """A check script's main(): its options, a gloo process group, `run(args, rank, world)`, the
    result written by rank 0, then run_and_leave's exit."""
    import datetime

    import deepspeed
    import torch.distributed as dist

    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    run_and_leave(rank, args.result, lambda: run(args, rank, world))
