"""The kinds of thing a path can be, each answering two questions: is this path me (`detect`,
positive only: precedence is the order of the registry's one list), and what does opening it
give (`open`).

Folder kinds come first: a run folder (its newest complete checkpoint), an HF Trainer folder (the
checkpoint inside, plus the Trainer's parts and step), Lightning's sharded folder (DCP plus
`meta.pt`), accelerate's `save_state` folder (two DCP subfolders as one). Then every registered
format, each through its adapter (`FormatKind`). The registry (formats/registry.py) holds the
list and runs the loop; nothing here imports a format package: the formats a folder kind is made
of are handed to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from ..storage.source import Source
from . import accelerate, lightning, run_folder, trainer
from .opened import Opened, Opener

if TYPE_CHECKING:
    from .protocols import Reader


@dataclass
class Spot:
    """What the loop looks at: a folder (`name` None), or the file `name` inside the folder `source`."""

    path: str  # as the user gave it (sentences name it)
    source: Source
    folder: bool  # `source` is the folder to read (else the file `name` in it)
    name: str | None = None
    tag: str | None = None  # --tag: a DeepSpeed tag, or a run folder's entry
    follow_links: bool | None = None
    optimizer: bool = True  # False: a ZeRO reader may count the optimizer's entries, not index them
    expect: str | None = None  # the format the caller asserts (e.g. "dcp")
    opener: Opener | None = None  # the registry's open_checkpoint: a run folder's entry is opened with it
    found: dict = field(default_factory=dict)  # what a kind's detect found, kept for its open


class Kind(Protocol):
    """One entry of the registry's ordered list."""

    name: str
    format: str | None  # the format it opens as; None: decided by what it leads to (run, trainer)
    takes_tag: bool  # --tag means something to it (else --tag is refused)
    wraps: bool  # its `open` hands the spot on to the kinds after it (`rest`) and adds to what they open
    finishes: bool  # its `open` returns what the registry's loop already finished (checked, annotated)

    def detect(self, spot: Spot) -> bool:
        """Is `spot` this kind? By content, positive only (never "and not another kind")."""

    def open(self, spot: Spot, rest: Callable[[], Opened]) -> Opened:
        """Open `spot`; `rest` opens it with the kinds after this one (for a kind that wraps one)."""


class RunFolderKind:
    """A training output folder: its newest complete checkpoint, or the one --tag names."""

    name, format, takes_tag, wraps, finishes = "run folder", None, True, False, True

    def detect(self, spot: Spot) -> bool:
        if not spot.folder:
            return False
        spot.found[self.name] = run_folder.resolvable(spot.source, spot.tag)
        return spot.found[self.name] is not None

    def open(self, spot: Spot, rest: Callable[[], Opened]) -> Opened:
        assert spot.opener is not None, "a run folder is opened through the registry"
        found = spot.found[self.name]
        run = run_folder.resolve(spot.path, spot.source, spot.opener, spot.tag, spot.follow_links, found)
        if run is None:
            return rest()
        opened = (
            run.opened
            if run.opened is not None and spot.expect is None  # read whole while choosing
            else spot.opener(run.path, spot.expect, run.tag, spot.follow_links, optimizer=spot.optimizer)
        )
        run.opened = None
        opened.run = run
        if opened.index.step is None:
            opened.index.step = run.step
        run_folder.announce(run)
        return opened


class TrainerKind:
    """An HF Trainer (or accelerate save_state) folder: the checkpoint inside, opened by the kinds
    after this one, with the Trainer's parts, side files and recorded step noted on it."""

    name, format, takes_tag, wraps, finishes = "HF Trainer folder", None, True, True, True

    def detect(self, spot: Spot) -> bool:
        if not spot.folder:
            return False
        spot.found[self.name] = trainer.describe(spot.source, spot.tag)
        return spot.found[self.name] is not None

    def open(self, spot: Spot, rest: Callable[[], Opened]) -> Opened:
        opened = rest()
        folder = spot.found[self.name]
        if opened.source is spot.source:
            opened.trainer = folder
            opened.index.metadata["hf_trainer"] = folder.as_json()
            if folder.step is not None:
                opened.index.step = folder.step
        return opened


class LightningKind:
    """Lightning's FSDP sharded folder: a DCP checkpoint with `meta.pt` (Lightning's own keys) beside it."""

    name, format, takes_tag, wraps, finishes = "Lightning sharded folder", "dcp", False, False, False

    def __init__(self, dcp: "Reader") -> None:
        self.dcp = dcp

    def detect(self, spot: Spot) -> bool:
        return (
            spot.folder
            and self.dcp.detect(spot.source)
            and lightning.META in spot.source.listdir("")
            and not spot.source.isdir(lightning.META)
        )

    def open(self, spot: Spot, rest: Callable[[], Opened]) -> Opened:
        index = self.dcp.read_index(spot.source)
        lightning.add_meta(spot.source, index)
        return Opened(spot.source, index, spot.path)


class AccelerateKind:
    """accelerate's save_state folder: `pytorch_model_fsdp_N/` and `optimizer_N/`, two DCP folders as one."""

    name, format, takes_tag, wraps, finishes = "accelerate folder", "dcp", False, False, False

    def detect(self, spot: Spot) -> bool:
        if not spot.folder:
            return False
        spot.found[self.name] = accelerate.parts(spot.source)
        return bool(spot.found[self.name])

    def open(self, spot: Spot, rest: Callable[[], Opened]) -> Opened:
        return Opened(spot.source, accelerate.read_index(spot.source, spot.found[self.name]), spot.path)


class FormatKind:
    """A registered format, through its adapter: its reader detects and indexes."""

    wraps = finishes = False

    def __init__(self, fmt: "Reader") -> None:
        self.fmt = fmt
        self.name = self.format = fmt.name
        self.takes_tag = fmt.capabilities.tags

    def detect(self, spot: Spot) -> bool:
        return self.fmt.detect(spot.source, spot.name, tag=spot.tag)

    def open(self, spot: Spot, rest: Callable[[], Opened]) -> Opened:
        return read_as(self.fmt, spot)


def read_as(fmt: "Reader", spot: Spot) -> Opened:
    """`spot` indexed by `fmt`'s reader (a file's index is rooted at the path as given)."""
    index = fmt.read_index(spot.source, name=spot.name, tag=spot.tag, optimizer=spot.optimizer)
    if spot.name is not None:
        index.root = spot.path
    return Opened(spot.source, index, spot.path)


__all__ = ["Spot", "Kind", "RunFolderKind", "TrainerKind", "LightningKind", "AccelerateKind", "FormatKind", "read_as"]
