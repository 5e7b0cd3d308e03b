"""What a ZeRO checkpoint is beyond its index: the groups, the files and the original structures.

The reader builds a `ZeroInfo` once from what it read (kept in `index.native`); convert builds
one from a DeepSpeed config; the writer lays out a checkpoint for a new world size from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...runner.torch_archive import Archive
from .files import ZeroFiles


@dataclass(frozen=True, kw_only=True)
class ZeroGroup:
    """One optimizer param group (stage 1/2) or sub-group (stage 3) as laid out on disk."""

    index: int  # position in the optimizer state (group, or sub-group)
    param_group: int  # the torch param group it belongs to
    params: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape), in flat-buffer order
    paddings: tuple[int, ...] | None = None  # stage 1/2: alignment padding after each parameter

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.params]


@dataclass(frozen=True, kw_only=True)
class StageNames:
    """Where a stage keeps its flat buffers in the optim-states file, and what it calls them."""

    masters: str  # the list of a rank's flat fp32 partitions, one per (sub-)group
    optimizer: str  # the wrapped torch optimizer's state_dict
    group: str  # a (sub-)group in messages


STAGE12 = StageNames(masters="single_partition_of_fp32_groups", optimizer="base_optimizer_state", group="group")
STAGE3 = StageNames(masters="fp32_flat_groups", optimizer="optimizer_state_dict", group="sub-group")


def stage_names(stage: int) -> StageNames:
    return STAGE12 if stage < 3 else STAGE3


@dataclass(frozen=True, kw_only=True)
class ZeroInfo:
    """What the DeepSpeed writer needs beyond the index: the layout and the original structures."""

    stage: int
    world_size: int
    files: ZeroFiles
    groups: list[ZeroGroup]
    frozen: dict[str, tuple[int, ...]]
    buffers: list[str]
    shared: dict[str, str]  # alias -> owner
    model_states: dict[int, Any] = field(default_factory=dict)  # rank -> lazy structure
    optim_states: dict[int, Any] = field(default_factory=dict)
    archives: dict[str, Archive] = field(default_factory=dict)  # none: templates convert built
    param_group_count: int = 0
    dtype: str = "float32"  # the module weights' precision
