"""Pure geometry of ZeRO partitions: which flat elements each rank holds.

Stage 1/2: each param group is one flat buffer (params in order, optional per-param alignment
padding), padded at the end to a multiple of 2*W; rank r owns [r*ps, (r+1)*ps) with ps = padded/W.
Stage 3: every parameter is padded to ceil(n/W)*W and rank r holds slice r of each; a sub-group's
flat tensor is its params' slices concatenated; sub-groups close when the running size of the
rank-local slices reaches sub_group_size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Placed:
    """A parameter inside a stage-1/2 group's flat buffer."""

    name: str
    numel: int
    offset: int


def stage12_group(names_numels: list[tuple[str, int]], paddings: list[int] | None,
                  world_size: int) -> tuple[list[Placed], int, int]:
    """(placed params, unpadded flat length incl. per-param padding, partition size)."""
    placed, offset = [], 0
    for i, (name, numel) in enumerate(names_numels):
        placed.append(Placed(name, numel, offset))
        offset += numel + (paddings[i] if paddings else 0)
    align = 2 * world_size
    padded = int(math.ceil(offset / align)) * align
    return placed, offset, padded // world_size


def stage12_slice_mappings(placed: list[Placed], partition_size: int, rank: int) -> list[tuple[str, int, int]]:
    """(name, numel, start-in-partition) of each param overlapping rank's partition, in order."""
    lo, hi = rank * partition_size, (rank + 1) * partition_size
    out = []
    for p in placed:
        a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
        if b > a:
            out.append((p.name, b - a, a - lo))
    return out


def stage3_slice(numel: int, world_size: int) -> int:
    """Elements each rank holds of a parameter (ceil(numel / W))."""
    return int(math.ceil(numel / world_size))


def stage3_sub_groups(names_numels: list[tuple[str, int]], world_size: int,
                      sub_group_size: int | None) -> list[list[tuple[str, int]]]:
    """Split one param group into sub-groups the way DeepSpeed's _create_fp16_sub_groups does."""
    total = sum(stage3_slice(n, world_size) for _, n in names_numels)
    if sub_group_size is None or sub_group_size >= total:
        return [list(names_numels)]
    groups, current, size = [], [], 0
    for i, (name, numel) in enumerate(names_numels):
        current.append((name, numel))
        size += stage3_slice(numel, world_size)
        if size >= sub_group_size or i == len(names_numels) - 1:
            groups.append(current)
            current, size = [], 0
    return groups
