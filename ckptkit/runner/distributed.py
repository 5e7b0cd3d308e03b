"""Running one operation as a torch.distributed job: every rank writes a share of the output files.

All ranks build the same plan (the same index, layout and file list, deterministically); the
output files are dealt out by bytes (largest first, each to the least loaded rank), so every
rank reads only what its own files need. Rank 0 creates the temporary output folder and the
lock, writes the small files that depend on everyone's results (DCP's .metadata, `latest`,
index JSON) and commits after every rank reported success. A rank that fails makes the whole
job fail with that rank's message, on every rank, at the next collective check; the process
group's timeout turns a vanished rank into an error instead of a hang.

Outside torchrun (no WORLD_SIZE in the environment) the group is the trivial one-process group
and nothing here touches torch.distributed.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

from .. import knobs
from ..errors import CkptkitError


class PeerError(CkptkitError):
    """Another rank of the job failed; its message is this one's."""


@dataclass
class Group:
    """The processes sharing one operation. rank 0 of world 1 is the plain single-process run."""

    rank: int = 0
    world: int = 1
    pg: Any = None
    failed: BaseException | None = field(default=None, repr=False)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    # ---- collectives (no-ops in one process) -------------------------------------------------

    def collective(self, fn: Any) -> Any:
        """Run the collective `fn`; a peer that stopped answering is one sentence (PeerError), kept in `failed`."""
        try:
            return fn()
        except RuntimeError as exc:  # gloo timeout or a peer that went away
            self.failed = PeerError(
                f"another rank of the job stopped answering (crashed, killed or stuck past the "
                f"{knobs.DIST_TIMEOUT:.0f} s timeout): {str(exc).splitlines()[0][:200]}"
            )
            raise self.failed from None

    def _gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        self.collective(lambda: dist.all_gather_object(out, obj, group=self.pg))
        return out

    def share(self, obj: Any) -> Any:
        """rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_root else None]
        self.collective(lambda: dist.broadcast_object_list(box, src=0, group=self.pg))
        return box[0]

    def gather_all(self, obj: Any) -> list[Any]:
        return self._gather(obj) if self.distributed else [obj]

    def check(self, error: BaseException | None) -> None:
        """Collective: every rank says whether it failed; if any did, every rank raises (its own
        error, or the first failing rank's message). After a failure no collective runs again,
        so ranks that learned of it at different calls cannot wait for each other."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        if self.failed is not None:
            raise error if error is not None else self.failed
        report = None if error is None else (type(error).__name__, str(error), isinstance(error, CkptkitError))
        reports = self._gather(report)
        bad = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
        if not bad:
            return
        if error is not None:
            self.failed = error
            raise error
        rank, (kind, message, ours) = bad[0]
        self.failed = PeerError(message if ours else f"rank {rank} failed: {kind}: {message}")
        raise self.failed

    def assign(self, weights: list[int]) -> list[int]:
        """The job indices this rank runs: largest first, each to the least loaded rank (ties to
        the lowest rank), the same answer on every rank."""
        load = [0] * self.world
        owner = [0] * len(weights)
        for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            owner[i] = r
            load[r] += max(1, weights[i])
        return [i for i, r in enumerate(owner) if r == self.rank]


LOCAL = Group()
_CURRENT: list[Group] = []


def current() -> Group:
    """The group from_environment() set up in this process, or the one-process group."""
    return _CURRENT[0] if _CURRENT else LOCAL


def report_failure(error: BaseException) -> None:
    """Tell the other ranks this one failed outside an output's collectives (e.g. while reading
    the source), so they stop at their next check instead of waiting for the timeout."""
    group = current()
    if group.distributed and group.failed is None:
        try:
            group.check(error)
        except BaseException:
            pass


def from_environment(timeout_s: float | None = None) -> Group:
    """The torchrun job this process belongs to (gloo on CPU, nccl when CUDA is available), or
    the one-process group. Initialises the default process group if nobody did (`timeout_s`:
    default knobs.DIST_TIMEOUT, CKPTKIT_DIST_TIMEOUT)."""
    if _CURRENT:
        return _CURRENT[0]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return LOCAL
    import torch
    import torch.distributed as dist

    timeout_s = knobs.DIST_TIMEOUT if timeout_s is None else timeout_s
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        _join(lambda: dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s)))
    group = group_of(None, timeout_s)
    _CURRENT.append(group)
    return group


def _join(rendezvous: Any) -> None:
    """Run torch's rendezvous where Ctrl-C cannot reach it: in a thread that blocks SIGINT, the main
    thread waiting. Inside it (TCPStore's connect loop, in C++) Python's signal handler cannot run:
    a Ctrl-C there made torch log an "Interrupted system call" retry with a C++ trace, and, landing
    in its retry delay, left the rank waiting for peers that had already gone, until the timeout.
    Now the signal goes to the main thread, whose handler ends the process at once (nothing is open
    during the rendezvous). Off the main thread (a library caller's thread) it runs as it is."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        rendezvous()
        return
    failure: list[BaseException] = []

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            rendezvous()
        except BaseException as exc:  # handed to the main thread, which raises it
            failure.append(exc)

    thread = threading.Thread(target=run, name="ckptkit-rendezvous", daemon=True)
    thread.start()
    thread.join()  # a Ctrl-C interrupts this wait: the handler runs here
    if failure:
        raise failure[0]


_GLOO: dict[Any, Any] = {}  # process group -> its gloo twin for object collectives


def group_of(pg: Any = None, timeout_s: float | None = None) -> Group:
    """The processes of `pg` (default: the default process group) as a Group; the one-process
    group when torch.distributed is not initialised. Object collectives go over gloo (CPU) even
    when the job's tensors use nccl: a gloo twin of `pg` is made once (a collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(pg) == 1:
        return LOCAL
    gloo = pg
    if dist.get_backend(pg) != "gloo":
        if pg not in _GLOO:
            ranks = dist.get_process_group_ranks(pg) if pg is not None else None
            extra = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s is not None else {}
            _GLOO[pg] = dist.new_group(ranks=ranks, backend="gloo", **extra)
        gloo = _GLOO[pg]
    return Group(dist.get_rank(pg), dist.get_world_size(pg), gloo)


def finish(group: Group, code: int) -> None:
    """Leave the job: a last barrier when everyone succeeded (rank 0 has committed by then), then
    exit at once. Tearing the process group down while gloo's threads still run aborts the
    process now and then, and a failed job must not wait for peers that already left."""
    import sys

    if group.distributed and group.failed is None and code == 0:
        import torch.distributed as dist

        try:
            group.collective(lambda: dist.barrier(group=group.pg))
        except CkptkitError:
            code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
