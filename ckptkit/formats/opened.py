"""What opening a path gives: the checkpoint (its source and index) and, when the path was a run
folder, which of its checkpoints was chosen and why.

Apart from the registry so that what opens checkpoints on the registry's behalf (run folders,
a Checkpointer's step folders) and what checks an opened one (structure.py) sit below it: they
take the registry's `open_checkpoint` as an `Opener` instead of importing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..index.types import CheckpointIndex
from ..storage.source import Source

if TYPE_CHECKING:
    from .trainer import TrainerFolder


@dataclass
class RunChoice:
    """The checkpoint chosen in a run folder, and why (`note`, one line for the user)."""

    folder: str  # the run folder, as given
    kind: str
    entry: str  # the chosen entry's name
    path: str  # the checkpoint to open (the entry, or the run folder itself with `tag`)
    tag: str | None  # a DeepSpeed tag to open `path` at (DeepSpeed save folders), else None
    step: int | None  # the step the trainer recorded (trainer_state.json) or the entry's name gives
    why: str  # why this one, e.g. "newest complete of 3 in this ...; checkpoint-3 is incomplete: ..."
    skipped: list[tuple[str, str]] = field(default_factory=list)  # newer entries passed over, and why
    opened: Opened | None = field(default=None, repr=False)  # the entry, when probing read it whole

    @property
    def note(self) -> str:
        """One line for the user: which checkpoint of the run folder is read, and why."""
        return f"{self.folder}: using {self.entry} ({self.why})"


@dataclass
class Opened:
    """A checkpoint ready to be read: its source (for bytes) and its index (for everything else)."""

    source: Source
    index: CheckpointIndex
    path: str
    trainer: TrainerFolder | None = None  # an HF Trainer checkpoint-N/ folder's parts
    run: RunChoice | None = None  # the checkpoint chosen when `path` was a run folder


class Opener(Protocol):
    """The registry's open_checkpoint, handed to what opens checkpoints below it."""

    def __call__(
        self,
        path: str,
        expect: str | None = None,
        tag: str | None = None,
        follow_links: bool | None = None,
        *,
        optimizer: bool = True,
    ) -> Opened: ...
