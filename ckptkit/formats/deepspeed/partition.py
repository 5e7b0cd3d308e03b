"""Pure geometry of ZeRO partitions: which flat elements each rank holds.

Stage 1/2: each param group is one flat buffer (params in order, optional per-param alignment
padding), padded at the end to a multiple of 2*W; rank r owns [r*ps, (r+1)*ps) with ps = padded/W.
Stage 3: every parameter is padded to ceil(n/W)*W and rank r holds slice r of each; a sub-group's
flat tensor is its params' slices concatenated; sub-groups close when the running size of the
rank-local slices reaches sub_group_size.

Both stages are described the same way, by a `RankShare` per rank: the reader cuts a rank's
flat tensors into per-parameter pieces with it, the writer assembles them from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence


class Slot(NamedTuple):
    """Elements [start, start+length) of parameter `name`, at `position` of a rank's flat tensor
    (a NamedTuple: one per parameter and rank, built ~10x faster than a frozen dataclass)."""

    name: str
    start: int
    length: int
    position: int


@dataclass(frozen=True, kw_only=True)
class RankShare:
    """What one rank holds of one (sub-)group's flat buffer."""

    slots: tuple[Slot, ...]  # the parameters' elements it holds, in order (none of zero length)
    own: int  # elements up to the end of the parameters: the fp32 masters' length
    size: int  # the partition's length with its end padding: the optimizer states'

    @property
    def end_padding(self) -> int:
        return self.size - self.own


def stage12_shares(
    params: Sequence[tuple[str, int]], paddings: Sequence[int] | None, world_size: int
) -> list[RankShare]:
    """Each rank's share of a stage-1/2 group of (name, numel), with its alignment paddings."""
    offsets, total = [], 0
    for i, (_, numel) in enumerate(params):
        offsets.append(total)
        total += numel + (paddings[i] if paddings else 0)
    align = 2 * world_size
    size = int(math.ceil(total / align)) * align // world_size
    shares = []
    for rank in range(world_size):
        lo = rank * size
        own = max(0, min(size, total - lo))
        slots = []
        for (name, numel), offset in zip(params, offsets):
            a, b = max(lo, offset), min(lo + own, offset + numel)
            if b > a:
                slots.append(Slot(name=name, start=a - offset, length=b - a, position=a - lo))
        shares.append(RankShare(slots=tuple(slots), own=own, size=size))
    return shares


_new_tuple = tuple.__new__  # a Slot without NamedTuple's Python-level __new__ (one per parameter and rank)


def stage3_shares(params: Sequence[tuple[str, int]], world_size: int) -> list[RankShare]:
    """Each rank's share of a stage-3 sub-group of (name, numel): slice r of every parameter."""
    pers = [stage3_slice(numel, world_size) for _, numel in params]  # computed once, not once per rank
    size = sum(pers)
    shares = []
    for rank in range(world_size):
        slots, position = [], 0
        for (name, numel), per in zip(params, pers):
            start = rank * per
            length = min(per, numel - start)
            if length > 0:
                slots.append(_new_tuple(Slot, (name, start, length, position)))
            position += per
        shares.append(RankShare(slots=tuple(slots), own=size, size=size))
    return shares


def rank_shares(
    stage: int, params: Sequence[tuple[str, int]], paddings: Sequence[int] | None, world_size: int
) -> list[RankShare]:
    """Each rank's share of one (sub-)group at `stage`."""
    if stage < 3:
        return stage12_shares(params, paddings, world_size)
    return stage3_shares(params, world_size)


def stage3_slice(numel: int, world_size: int) -> int:
    """Elements each rank holds of a parameter (ceil(numel / W))."""
    return int(math.ceil(numel / world_size))


def stage3_sub_groups(
    names_numels: list[tuple[str, int]], world_size: int, sub_group_size: int | None
) -> list[list[tuple[str, int]]]:
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
