"""Benchmark (CPU, one process): torch's dcp.load through ckptkit.StorageReader against torch's own
FileSystemReader, on the same DCP checkpoint.

    python benchmarks/bench_storage_reader.py [--size-mb 400] [--repeat 5] [--warm] [--work /tmp/ckptkit-bench-reader]

Writes, with torch's dcp.save, a checkpoint of about --size-mb MB: a model-like state dict of fp32
matrices and vectors of mixed sizes plus AdamW-like moments and a few plain values. Then, --repeat
times each (median reported, the order of the two readers alternating between repeats), times
`dcp.load(state, storage_reader=R)` into a fresh zeroed copy of the state dict, the reader made inside
the timed region (ckptkit's indexes the checkpoint when made; torch's reads .metadata inside
dcp.load). The page cache is synced before every timed load, and dropped too when run as root (unless
--warm), so each starts alike. After every load the state must equal what was saved bit for bit (the state is
zeroed before each load, so a load that does nothing cannot pass). Prints a Markdown table with the
ratio ckptkit / torch, the machine line and the date; exits 1 when a check failed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _measure import drop_caches, machine_line  # noqa: E402


def make_state(size_mb: int) -> dict:
    """A model's weights (mixed matrix sizes, vectors) and AdamW-like state, ~size_mb MB in all."""
    import torch

    g = torch.Generator().manual_seed(0)
    model: dict = {}
    optim: dict = {"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                 "weight_decay": 0.1, "params": []}]}
    total, layer = 0, 0
    budget = size_mb * 2 ** 20
    while total < budget:
        for name, shape in ((f"layers.{layer}.attn.weight", (1024, 1024)), (f"layers.{layer}.mlp.weight", (2048, 1024)),
                            (f"layers.{layer}.norm.weight", (1024,))):
            model[name] = torch.randn(shape, generator=g)
            optim["state"][name] = {"exp_avg": torch.randn(shape, generator=g),
                                    "exp_avg_sq": torch.rand(shape, generator=g), "step": torch.tensor(10.0)}
            optim["param_groups"][0]["params"].append(name)
            total += 3 * model[name].numel() * 4
        layer += 1
    return {"model": model, "optim": optim}


def zeroed_like(state: dict) -> dict:
    import torch

    def walk(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return None if isinstance(v, (int, float, tuple)) and not isinstance(v, bool) else v

    return walk(state)


def equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def timed_load(target: dict, kind: str, path: str, warm: bool = False) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    import ckptkit

    os.sync()
    if not warm:
        drop_caches()
    t0 = time.perf_counter()
    reader = ckptkit.StorageReader(path) if kind == "ckptkit" else FileSystemReader(path)
    dcp.load(target, storage_reader=reader)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--work", default="/tmp/ckptkit-bench-reader")
    ap.add_argument("--warm", action="store_true", help="keep the page cache (the checkpoint read from memory)")
    args = ap.parse_args()
    warnings.simplefilter("ignore", UserWarning)  # dcp's "assuming a single process"
    import torch.distributed.checkpoint as dcp

    import ckptkit  # noqa: F401  (imports paid before timing)
    from ckptkit.hooks import storage_reader  # noqa: F401

    os.makedirs(args.work, exist_ok=True)
    path = os.path.join(args.work, "dcp")
    shutil.rmtree(path, ignore_errors=True)
    saved = make_state(args.size_mb)
    dcp.save(saved, checkpoint_id=path)
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    cold = not args.warm and drop_caches()
    times: dict[str, list[float]] = {"ckptkit": [], "torch": []}
    ok = True
    for kind in ("ckptkit", "torch"):  # one untimed load each: the first-call costs (lazy imports)
        timed_load(zeroed_like(saved), kind, path)
    for i in range(args.repeat):
        for kind in (("ckptkit", "torch") if i % 2 == 0 else ("torch", "ckptkit")):
            target = zeroed_like(saved)
            times[kind].append(timed_load(target, kind, path, args.warm))
            ok = ok and equal(saved, target)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n### dcp.load through ckptkit.StorageReader vs FileSystemReader: {size / 2**20:.0f} MB DCP "
          f"checkpoint, {len(saved['model'])} parameters, one process, median of {args.repeat}\n")
    print(f"{machine_line()}; page cache dropped before every timed load: {'yes' if cold else ('no (--warm)' if args.warm else 'no (not root)')}\n")
    print("| reader | median (s) | runs (s) |\n|---|---:|---|")
    for kind, label in (("ckptkit", "ckptkit.StorageReader"), ("torch", "FileSystemReader")):
        print(f"| {label} | {med[kind]:.2f} | {', '.join(f'{t:.2f}' for t in times[kind])} |")
    print(f"\nckptkit / torch: {med['ckptkit'] / med['torch']:.2f}x; every load equal to the saved state "
          f"bit for bit: {ok}")
    shutil.rmtree(path, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
