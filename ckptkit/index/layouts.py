"""Target layouts: which rank holds which box of each tensor.

Writers receive a Layout (a value) rather than ad-hoc arguments, so "FSDP2 at 3 ranks" or
"whole tensors" is described once, here, and every format writes it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import Box, CheckpointIndex, TensorEntry


def chunk_dim0(shape: tuple[int, ...], world_size: int) -> list[Box]:
    """FSDP2's Shard(0) boxes: torch.chunk sizes, empty boxes for ranks past the end."""
    if world_size < 1:
        raise ValueError("world size must be at least 1")
    if len(shape) == 0:
        raise ValueError("a 0-d tensor cannot be sharded on dim 0")
    d0 = shape[0]
    step = -(-d0 // world_size) if d0 else 0
    boxes = []
    for r in range(world_size):
        start = min(r * step, d0)
        size = max(0, min(step, d0 - start))
        boxes.append(Box((start,) + (0,) * (len(shape) - 1), (size,) + tuple(shape[1:])))
    return boxes


@dataclass
class Assignment:
    """One box of a tensor written by one rank."""

    rank: int
    box: Box


@dataclass
class Layout:
    """For each tensor key, the boxes each rank writes (non-overlapping, covering the tensor)."""

    world_size: int
    tensors: dict[str, list[Assignment]] = field(default_factory=dict)
    description: str = ""
    # which rank writes each value (bytes item); None: rank 0 writes them all
    object_ranks: dict[str, int] | None = None
    # True: each assignment is one chunk as torch writes it, never cut into memory-sized slabs
    exact_chunks: bool = False
    # the state dict's flat key order (tensors and values), which torch writes items in; None: as listed
    key_order: list[str] | None = None


def is_sharded(entry: TensorEntry) -> bool:
    """A tensor the source split across ranks (more than one piece), as opposed to replicated."""
    return len(entry.pieces) > 1


def fsdp2_layout(index: CheckpointIndex, world_size: int) -> Layout:
    """FSDP2 at `world_size`: tensors the source sharded get torch.chunk on dim 0; tensors the
    source kept whole (buffers, steps, 0-d values) stay whole on rank 0, written once. A source
    saved by one process tells nothing about sharding, so all its N-d tensors are chunked."""
    layout = Layout(world_size, description=f"FSDP2 Shard(0) over {world_size} ranks")
    source_unsharded = index.world_size in (None, 1)
    for key, entry in index.tensors.items():
        sharded = is_sharded(entry) or source_unsharded
        if len(entry.shape) == 0 or not sharded:
            layout.tensors[key] = [Assignment(0, Box.whole(entry.shape))]
            continue
        boxes = chunk_dim0(entry.shape, world_size)
        assigns = [Assignment(r, b) for r, b in enumerate(boxes) if b.numel]
        if not assigns:  # a tensor with no elements still needs one (empty) chunk
            assigns = [Assignment(0, boxes[0])]
        layout.tensors[key] = assigns
    return layout
