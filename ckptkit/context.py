"""One RunContext per run: what every layer that moves bytes shares.

The command line builds exactly one (cli/context.py) and passes it down: operations hand it to the
readers and writers they call, writers to the executor. It holds the memory budget, the worker
count, the progress callback, the torchrun group sharing the run, how Ctrl-C reaches it, and the
output options. No layer keeps a private default of its own (a writer's `workers=4`, a check's
own 8 MiB slab): the defaults are knobs.py's, read once when the context is made.

Every buffer comes out of the budget: a caller that holds `n` buffers at once in each worker
takes `slab_bytes_for(n)` bytes per buffer, so all workers together stay within `memory_budget`
(torchsnapshot's budgeted scheduler, in its simplest form).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import interrupts, knobs
from .progress import NullProgress, Progress
from .runner.distributed import LOCAL, Group

MIN_SLAB = 1 << 20  # the smallest share a buffer gets, whatever the budget (knobs.slab_bytes agrees)


@dataclass
class RunContext:
    memory_budget: int = field(default_factory=lambda: knobs.MEMORY_BUDGET)
    workers: int = field(default_factory=lambda: knobs.WORKERS)
    progress: Progress = field(default_factory=NullProgress)
    overwrite: bool = False
    group: Group = field(default_factory=lambda: LOCAL)  # the torchrun job sharing this operation
    follow_links: bool | None = None  # let a local source's links lead outside it (None: CKPTKIT_FOLLOW_LINKS)
    fixed_slab: int | None = None  # a slab of exactly this many bytes, budget aside (tests of slab edges)

    def slab_bytes_for(self, buffers: int) -> int:
        """Bytes each of `buffers` buffers one worker holds at once may take: the budget shared
        by all workers and their buffers."""
        if self.fixed_slab is not None:
            return self.fixed_slab
        return max(MIN_SLAB, self.memory_budget // (max(1, buffers) * max(1, self.workers)))

    @property
    def slab_bytes(self) -> int:
        """One worker's slab: room for a source read and a target buffer each."""
        return self.slab_bytes_for(2)

    def check(self) -> None:
        """A point where the run may stop: raises interrupts.Cancelled after the command line's Ctrl-C
        (interrupts.cancel), interrupts.Stopped when a sibling job of the executor failed."""
        interrupts.check()


def context_of(ctx: RunContext | None = None, options: RunContext | None = None) -> RunContext:
    """The context an operation runs with: `ctx`, or the older `options=` keyword, or the defaults."""
    return ctx or options or RunContext()


__all__ = ["RunContext", "context_of", "MIN_SLAB"]
