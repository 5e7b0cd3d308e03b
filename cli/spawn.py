"""`--nproc P`: run this very command as a P-process torch.distributed job on this machine.

Starts P copies of `python -m ckptkit <the same arguments>` with the environment torchrun would
give them (MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK), waits for all, and exits with the
first failure's status. If one process fails the others stop at their next check (they hear of
it through the process group) or, at the latest, when this launcher ends them after a grace period.
Ctrl-C (to this launcher alone, or to the whole terminal group) is passed on to every process;
they remove what they wrote, and the launcher reports the interrupt once. Processes that do not
finish within INTERRUPT_GRACE_S are killed and what they left next to OUT is swept.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
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


def relaunch(nproc: int, out: str | None = None) -> int:
    from ckptkit import interrupts

    from .sigint import QUIET_ENV

    args = _without_nproc(sys.argv[1:])
    port = _free_port()
    with interrupts.needs_cleanup():  # Ctrl-C: pass it on and wait for the processes to clean up
        procs = []
        for rank in range(nproc):
            if interrupts.cancelled.is_set():
                break  # Ctrl-C while starting: start no more
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                WORLD_SIZE=str(nproc),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(nproc),
            )
            env.setdefault("OMP_NUM_THREADS", "1")
            env[QUIET_ENV] = "1"  # this launcher reports an interrupt, once
            procs.append(subprocess.Popen([sys.executable, "-m", "ckptkit", *args], env=env))
        codes, killed = _wait(procs, interrupts.cancelled)
    if len(procs) == nproc and not any(codes):
        # every process succeeded: the output is committed, so a Ctrl-C that came after rank 0's
        # commit changes nothing. It must not be reported either: the command's wrapper turns a
        # pending Ctrl-C into exit 130 ("no output"), so the launcher, like an output that
        # commits, marks the work done and forgets it (a later Ctrl-C is then ignored too)
        interrupts.committed.set()
        interrupts.cancelled.clear()
        return 0
    if out and "://" not in out:
        from ckptkit.storage.rename_output import recover

        # every process has ended and the job failed: what one left next to OUT (killed, or
        # stopped between taking the lock and arming its cleanup) is a dead run's, swept under
        # OUT's lock
        recover(out)
    if interrupts.cancelled.is_set() or INTERRUPTED in codes:
        raise interrupts.Cancelled()
    return next((c for c in codes if c), 0)


INTERRUPTED = 130
INTERRUPT_GRACE_S = 20.0


def _wait(procs: list[subprocess.Popen], cancelled: threading.Event) -> tuple[list[int], bool]:
    """Wait for every process: (exit codes in order of failure first, whether any was killed)."""
    failures: list[int] = []
    deadline: float | None = None
    forwarded = killed = False
    while True:
        codes = [p.poll() for p in procs]
        for code in codes:
            if code not in (None, 0) and not failures:
                failures.append(code)
                deadline = time.monotonic() + GRACE_S
        if cancelled.is_set() and not forwarded:
            forwarded = True
            for p in procs:
                p.send_signal(signal.SIGINT)  # a no-op for a process that has ended
            deadline = min(deadline or math.inf, time.monotonic() + INTERRUPT_GRACE_S)
        if all(c is not None for c in codes):
            return failures + [c for c in codes if c is not None], killed
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    killed = True
        time.sleep(0.05)
