"""`ckptkit demo`: a real checkpoint, then inspect, reshard 2->3, consolidate, verify."""

from __future__ import annotations

import os
import shutil
import time
from typing import Callable

from ..errors import OutputError


def _print_lines(*lines: str) -> None:
    print(*lines, sep="\n")


def run_demo(out: str, say: Callable[..., None] = _print_lines) -> None:
    """`say(*lines)` prints each argument as one line (the CLI's escapes each)."""
    from ..ops.consolidate import consolidate
    from ..ops.inspect import inspect, render
    from ..context import RunContext
    from ..ops.reshard import reshard
    from ..ops.verify import verify
    from .train import train_and_save

    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    ours = ("fsdp2-2ranks", "fsdp2-3ranks", "safetensors")
    foreign = [n for n in os.listdir(out) if n not in ours + ("bf16",) and not n.startswith(".")]
    if foreign:
        raise OutputError(
            f"{out}: holds files the demo did not write ({', '.join(foreign[:3])}); choose an empty --out"
        )
    for name in ours + ("bf16",):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    src, resharded, st = (os.path.join(out, n) for n in ours)

    say("1. training a small model with FSDP2 on 2 CPU processes (gloo) and saving it with DCP ...")
    t0 = time.time()
    train_and_save(src, world_size=2, steps=3)
    say(f"   wrote {src} in {time.time() - t0:.1f}s", "")

    say(f"2. ckptkit inspect {src}")
    opened, report = inspect(src)
    say(*("   " + line for line in render(opened, report, max_rows=12)), "")

    say(f"3. ckptkit reshard {src} {resharded} --to 3")
    res = reshard(src, resharded, 3, ctx=RunContext())
    say(f"   {res.tensors} tensors now laid out for 3 ranks: {', '.join(res.files)}", "")

    say(f"4. ckptkit consolidate {resharded} {st}")
    cres = consolidate(resharded, st)
    say(f"   {cres.model_tensors} model tensors -> {', '.join(cres.files)}", "")

    say("5. ckptkit verify --deep on all three")
    for path in (src, resharded, st):
        _, problems = verify(path, deep=True)
        state = "ok" if not problems else f"{len(problems)} problem(s): {problems[0]}"
        say(f"   {path}: {state}")
    say("", "Try them yourself:")
    say(f"   ckptkit inspect {resharded}")
    say(f"   ckptkit consolidate {src} {out}/bf16 --dtype bf16")
    say(f"   python -c \"from safetensors.torch import load_file; print(load_file('{st}/model.safetensors').keys())\"")
