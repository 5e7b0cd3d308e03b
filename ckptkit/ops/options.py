"""Options every data-moving operation shares."""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import knobs
from ..progress import NullProgress, Progress
from ..runner.distributed import LOCAL, Group


@dataclass
class RunOptions:
    memory_budget: int = field(default_factory=lambda: knobs.MEMORY_BUDGET)
    workers: int = field(default_factory=lambda: knobs.WORKERS)
    progress: Progress = field(default_factory=NullProgress)
    overwrite: bool = False
    group: Group = field(default_factory=lambda: LOCAL)  # the torchrun job sharing this operation
    follow_links: bool | None = None  # let a local source's links lead outside it (None: CKPTKIT_FOLLOW_LINKS)

    @property
    def slab_bytes(self) -> int:
        return knobs.slab_bytes(self.memory_budget, self.workers)
