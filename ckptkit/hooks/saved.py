"""What a Checkpointer step holds besides the model and optimizer: `extra` (what save() was
given, tensors included) and `states` (each named object's state_dict(), one per rank), read
back as nested values from the checkpoint's index."""
from __future__ import annotations

from typing import Any

from ..index.flatten import unflatten
from ..index.types import CheckpointIndex

STATES = "states"


def rank_key(rank: int) -> str:
    return f"rank_{rank}"


def has_prefix(index: CheckpointIndex, prefix: tuple[str, ...]) -> bool:
    n = len(prefix)
    return any(path_of(e.path, e.key)[:n] == prefix
               for entries in (index.tensors.values(), index.objects.values()) for e in entries)


def template(index: CheckpointIndex, prefix: tuple[str, ...]) -> dict | None:
    """A state dict shaped like the entries under `prefix` (empty tensors of the saved dtype and
    shape, None for other values) for `ckptkit.load` to fill; None when there are none."""
    import torch

    from ..index.dtypes import torch_dtype

    n = len(prefix)
    items: list[tuple[tuple, Any]] = []
    for t in index.tensors.values():
        path = path_of(t.path, t.key)
        if path[:n] == prefix:
            items.append((path[n:], torch.empty(tuple(t.shape), dtype=torch_dtype(t.dtype))))
    for o in index.objects.values():
        path = path_of(o.path, o.key)
        if path[:n] == prefix:
            items.append((path[n:], None))
    return unflatten(items) if items else None


def path_of(path: tuple | None, key: str) -> tuple:
    """An entry's nesting; its key split on dots where the index did not record one."""
    return tuple(path) if path else tuple(key.split("."))
