"""`--nproc P`: run this very command as a P-process torch.distributed job on this machine.

Starts P copies of `python -m ckptkit <the same arguments>` with the environment torchrun would
give them (MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK), waits for all, and exits with the
first failure's status. If one process fails the others stop at their next check (they hear of
it through the process group) or, at the latest, when this launcher ends them after a grace period.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

GRACE_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def relaunch(nproc: int) -> int:
    args = _without_nproc(sys.argv[1:])
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                   RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))
        env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen([sys.executable, "-m", "ckptkit", *args], env=env))
    first_failure: int | None = None
    deadline: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        for code in codes:
            if code not in (None, 0) and first_failure is None:
                first_failure = code
                deadline = time.monotonic() + GRACE_S
        if all(c is not None for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return first_failure or 0
