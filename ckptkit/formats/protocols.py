"""The contract every format keeps: a Reader, a Writer, and what the writer can produce.

Operations never ask which format a checkpoint is; they ask the registry (formats/registry.py)
what its format can do: "can it be resharded in its own format?", "are its tensors flat ZeRO
partitions?". A new format is one adapter object (formats/<format>/format.py) that answers these
through its `capabilities`, registered once; no operation changes (Orbax's one handler
contract per kind of item).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from ..index.dtypes import itemsize
from ..index.types import TensorEntry

if TYPE_CHECKING:
    from ..context import RunContext
    from ..index.layouts import Layout
    from ..index.types import CheckpointIndex
    from ..runner.fetch import Fetcher
    from ..storage.source import Source

ANY_WORLD = "any M >= 1"  # a writer that lays its output out for any number of ranks
ONE_WORLD = "1"  # a writer whose output is one whole copy, read by any number of ranks

FSDP2_SHARDS = "fsdp2 shard(0)"  # torch.chunk on dim 0 per rank, replicated tensors once
ZERO_PARTITIONS = "zero1/2/3 flat partitions"  # DeepSpeed's flat groups cut into equal rank ranges
WHOLE_TENSORS = "whole tensors"  # every tensor in one piece

# what `reshard --to` can name besides a world size, where a format's writer lays it out
TO_MESH = "device mesh"  # mesh=dp_shard:4,tp:2 (the writer's `reshard_mesh`)
TO_PARALLEL_SIZES = "parallel sizes"  # tp=2,pp=2,ep=2,dp=4 (the writer's `reshard_parallel`)

# index.metadata key: {"tensors": n, "values": m}, the optimizer's per-parameter state entries a
# reader opened with optimizer=False (registry.open_checkpoint; consolidate writing the weights
# alone) counted and left out of the index, so that what is not written can still be said
UNINDEXED_OPTIMIZER = "unindexed_optimizer"


@dataclass(frozen=True)
class StepFolders:
    """How a format names the folder of one training step's save by default (DeepSpeed's tag), in
    both directions, so a training hook and the run-folder scans ask the format, not a spelling."""

    name: "Callable[[int], str]"  # step -> folder name
    step_of: "Callable[[str], int | None]"  # folder name -> step, None when it is not one


@dataclass(frozen=True)
class Capabilities:
    """What a format's writer produces and what its reader's index means, declared once."""

    layouts: tuple[str, ...]  # the layouts its writer lays tensors out in
    world_sizes: str  # ANY_WORLD or ONE_WORLD
    optimizer_state: bool  # its files carry optimizer state (safetensors: weights only)
    reshards: bool  # `reshard` rewrites it in its own format for a new world size
    flat_partitions: bool = False  # its tensors are flat partitions: the training state comes from its own records
    recipe_keys: bool = False  # its keys are already torch's state-dict flattening (ckptkit.load reads it as is)
    library_check: bool = False  # verify --deep also has the format's own library open every file
    tags: bool = False  # its reader takes --tag (a DeepSpeed tag); --tag on any other format is refused
    # file names its reader is handed when no format recognised a file's content, to say precisely why
    suffixes: tuple[str, ...] = ()
    reshard_targets: tuple[str, ...] = ()  # TO_MESH, TO_PARALLEL_SIZES: what else `reshard` lays out
    # top-level keys the format's own loader writes and hands back (DeepSpeed's client state is the rest)
    own_keys: frozenset[str] = frozenset()
    step_folders: StepFolders | None = None  # its saves' default folder names, where it has them
    # why `convert` cannot read a training state from it yet (one clause; empty: it can)
    convert_refusal: str = ""
    # the flat keys in the order the framework's own save walked its state dict, where the files
    # record it (DCP's planner data): convert lays a param group's values out in that order
    saved_key_order: Callable[[Source], list[str]] | None = None
    model_only_reshard: bool = False  # its reshard_parallel can leave the optimizer out (--model-only)

    def writes(self, layout: str) -> bool:
        return layout in self.layouts

    def writes_world(self, world_size: int) -> bool:
        return world_size >= 1 and (self.world_sizes == ANY_WORLD or world_size == 1)

    def reshards_to(self, target: str) -> bool:
        """`reshard` lays this format out for `target` (TO_MESH, TO_PARALLEL_SIZES) in its own format."""
        return self.reshards and target in self.reshard_targets


@dataclass(frozen=True)
class ReadOptions:
    """What a caller asks of a read (the Reader protocol's keywords, as one record): `name`, the
    one file to read; `tag`, a DeepSpeed tag; `optimizer` False, the optimizer's per-parameter
    state may be counted instead of indexed."""

    name: str | None = None
    tag: str | None = None
    optimizer: bool = True


class IndexReader:
    """The Reader protocol's `read_index`, written once for every adapter: each says only how it
    reads (`read`, given the options as one record)."""

    def read_index(
        self,
        source: "Source",
        ctx: "RunContext | None" = None,
        *,
        name: str | None = None,
        tag: str | None = None,
        optimizer: bool = True,
    ) -> "CheckpointIndex":
        return self.read(source, ReadOptions(name=name, tag=tag, optimizer=optimizer))

    def read(self, source: "Source", options: ReadOptions) -> "CheckpointIndex":
        raise NotImplementedError(f"{type(self).__name__} reads no index")


class CannotReshard:
    """A format whose output is one whole copy: there is nothing laid out per rank to redo."""

    name: str

    def reshard(self, opened: Any, out: object, world_size: int, ctx: "RunContext") -> list[str]:
        raise NotImplementedError(f"{self.name} is not laid out by world size (capabilities.reshards is False)")

    def refuse_relayout(self, where: str, index: "CheckpointIndex") -> None:
        """One whole copy: any layout can be made from it."""


@runtime_checkable
class Reader(Protocol):
    """Finds its format in a source and indexes it (never decides what happens to the data).

    Optional: `consolidated_model(index, model, include_optimizer) -> (model, entries, notes)`, for a
    format that stores its model otherwise than its state_dict() names it (MCore's stacked layers):
    consolidate's output names mapped to keys, the entries of keys it made, and notes.
    Optional: `training_index(index, optimizer, model_only_hint, where) -> (index, notes)`, for a format that
    keeps its training state otherwise than torch names it (MCore: stacked layers, param groups
    without members): the same checkpoint as torch's `model.<name>`, `optim.state.<name>.<key>`,
    `optim.param_groups.<g>.<hyper>`, which convert (and consolidate --include-optimizer) read."""

    name: str

    def detect(self, source: "Source", name: str | None = None, *, tag: str | None = None) -> bool:
        """Is `source` (a folder; or its file `name`) this format? By content, never by name alone;
        positive only: which format wins when two would is the registry's order, not a detect's."""

    def read_index(
        self,
        source: "Source",
        ctx: "RunContext | None" = None,
        *,
        name: str | None = None,
        tag: str | None = None,
        optimizer: bool = True,
    ) -> "CheckpointIndex":
        """The canonical index of `source` (`name`: its one file; `tag`: a DeepSpeed tag; `optimizer`
        False: the optimizer's per-parameter state may be counted instead of indexed)."""

    def refuse_relayout(self, where: str, index: "CheckpointIndex") -> None:
        """Raise one sentence when `index` cannot be laid out afresh from its training state (convert
        to ZeRO templates): a layout only this format's own reshard rewrites. Else nothing."""


@runtime_checkable
class Writer(Protocol):
    """Turns a target (what to write, laid out) into files in an output, within ctx's budget."""

    name: str
    capabilities: Capabilities

    def write(self, target: Any, out: Any, ctx: "RunContext") -> list[str]:
        """Write `target` (this format's *Target dataclass) into `out`; the file names written."""

    def reshard(self, opened: Any, out: Any, world_size: int, ctx: "RunContext") -> list[str]:
        """`opened` (a registry.Opened of this format) laid out for `world_size` ranks (only where
        capabilities.reshards). A writer whose capabilities.reshard_targets name TO_MESH also has
        `reshard_mesh(opened, out, mesh, ctx, *, source_mesh, tp_dim_for) -> (files, note)`; one
        naming TO_PARALLEL_SIZES, `reshard_parallel(opened, out, sizes, ctx) -> files` (or `(files,
        notes)`; with `model_only=True` where capabilities.model_only_reshard)."""


# ---- what each writer is given ----------------------------------------------------------------------


@dataclass(frozen=True)
class DcpTarget:
    index: "CheckpointIndex"
    fetcher: "Fetcher"
    layout: "Layout"
    source: "Source | None" = None  # the DCP checkpoint `index` was read from: its bytes items copied as they are


@dataclass(frozen=True)
class ZeroTarget:
    index: "CheckpointIndex"  # a DeepSpeed index read by ckptkit (its ZeroInfo is the template)
    source: "Source"
    world_size: int


@dataclass(frozen=True)
class FlatGroup:
    """One param group of a ZeRO checkpoint built from a training state: its (name, shape) params
    in flat-buffer order and, at stage 1/2, the alignment padding after each (None: none)."""

    params: tuple[tuple[str, tuple[int, ...]], ...]
    paddings: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ZeroStateTarget:
    """A ZeRO checkpoint of a training state (convert --to zeroN), laid out by convert from a
    DeepSpeed config: `index`'s tensors (read from `source`), the model- and optim-states files'
    templates, and each param group's layout. The DeepSpeed format names the files (the tag of
    `step`) and writes them for `world_size` ranks; `source_index` is what the state was read from
    (a layout DeepSpeed's writer cannot rebuild from a state is refused)."""

    index: "CheckpointIndex"
    source: "Source"
    source_index: "CheckpointIndex"
    stage: int
    world_size: int
    step: int
    precision: str  # the module weights' dtype (bfloat16: the files' bf16_ prefix)
    groups: tuple[FlatGroup, ...]
    model_template: dict
    optim_template: dict
    frozen: dict[str, tuple[int, ...]]  # frozen params and their shapes
    buffers: tuple[str, ...]
    shared: dict[str, str]  # tied params: name -> the name it shares
    zero_config: dict  # the config's zero_optimization section (sub_group_size)


@dataclass(frozen=True)
class TorchSaveTarget:
    name: str
    index: "CheckpointIndex"
    fetcher: "Fetcher"
    keys: list[str] | None = None
    include_objects: bool = True
    key_map: dict[str, tuple] | None = None


@dataclass
class OutTensor:
    """One tensor of a safetensors target: the entry to read, the name and dtype to write it as."""

    name: str
    entry: TensorEntry
    dtype: str  # output dtype

    @cached_property
    def nbytes(self) -> int:  # (asked several times per tensor while planning and writing shards)
        return math.prod(self.entry.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class UniversalTarget:
    """A DeepSpeed universal checkpoint (what ds_to_universal writes) under `tag`: for each trainable
    parameter its states (`"fp32"`: the master, read as float32; `"exp_avg"`...: tensors shaped
    like it; `"step"`: a number), the model-states file's index (`module.<name>` tensors and
    DeepSpeed's and the client's values) and zero/optimizer_state.pt's values; all read through
    `fetcher`."""

    fetcher: "Fetcher"
    params: dict[str, dict[str, Any]]
    model_states: "CheckpointIndex"
    optimizer_state: dict[str, Any]
    tag: str


@dataclass(frozen=True)
class SafetensorsTarget:
    fetcher: "Fetcher"
    tensors: list[OutTensor]
    max_shard_bytes: int
    basename: str = "model"
    aliases: dict[str, str] | None = None
    objects: dict | None = None


__all__ = [
    "Capabilities",
    "CannotReshard",
    "Reader",
    "Writer",
    "DcpTarget",
    "ZeroTarget",
    "ZeroStateTarget",
    "FlatGroup",
    "StepFolders",
    "TorchSaveTarget",
    "SafetensorsTarget",
    "UniversalTarget",
    "OutTensor",
    "ANY_WORLD",
    "TO_MESH",
    "TO_PARALLEL_SIZES",
    "ONE_WORLD",
    "FSDP2_SHARDS",
    "ZERO_PARTITIONS",
    "WHOLE_TENSORS",
]
