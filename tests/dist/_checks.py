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
