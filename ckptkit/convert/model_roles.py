"""The model tensors no param group lists, sorted for a training state: frozen parameters,
buffers, and ties (a tensor bit for bit equal to a trainable one it shares its shape with, read
slab by slab within the run's budget).
"""

from __future__ import annotations

import fnmatch
import itertools

from ..formats.registry import Opened
from ..index import geometry
from ..index.dtypes import is_floating, itemsize
from ..index.layouts import is_sharded
from ..index.types import Box, TensorEntry
from ..runner.fetch import Fetcher
from ..runner.stream import find_aliases


def classify_untracked(
    opened: Opened,
    model: dict[str, TensorEntry],
    trainable: set[str],
    frozen_patterns: tuple[str, ...],
    fetcher: Fetcher,
    slab_bytes: int,
    *,
    weights_only: bool = False,
) -> tuple[list[str], list[str], dict[str, str]]:
    """Sort the model tensors outside the param groups into frozen params, buffers and ties.
    `weights_only`: the source has no optimizer (a safetensors file, a plain state dict), so no
    tensor is known to be a buffer: a floating N-d one is a parameter (FSDP2 shards it), and only
    what cannot be a parameter (an integer or bool tensor, a 0-d value) is a buffer."""
    aliases = find_aliases(model)
    multi_rank = (opened.index.world_size or 1) > 1
    frozen, buffers, ties = [], [], {}
    by_shape: dict[tuple, list[str]] = {}
    for t in (n for n in model if n in trainable):
        by_shape.setdefault((model[t].shape, model[t].dtype), []).append(t)
    for name, e in model.items():
        if name in trainable:
            continue
        if name in aliases and aliases[name] in trainable:
            ties[name] = aliases[name]
            continue
        owner = next(
            (
                t
                for t in by_shape.get((e.shape, e.dtype), [])
                if e.numel > 0 and bit_identical(fetcher, e, model[t], slab_bytes)
            ),
            None,
        )
        if owner is not None:
            ties[name] = owner
        elif any(fnmatch.fnmatchcase(name, p) for p in frozen_patterns):
            frozen.append(name)
        elif is_floating(e.dtype) and e.shape and multi_rank and is_sharded(e):
            frozen.append(name)  # FSDP shards parameters; buffers stay whole on every rank
        elif is_floating(e.dtype) and e.shape and weights_only and not multi_rank:
            frozen.append(name)  # nothing says it is a buffer: laid out as the parameter it most likely is
        else:
            buffers.append(name)
    return frozen, buffers, ties


def bit_identical(fetcher: Fetcher, a: TensorEntry, b: TensorEntry, slab_bytes: int) -> bool:
    """Same bytes, read slab by slab and stopping at the first difference (a few elements first,
    so a frozen layer shaped like a trainable one costs almost nothing). Two slabs are held at
    once: `slab_bytes` is each one's share of the run's budget (RunContext.slab_bytes_for(2))."""
    head = Box((0,) * len(a.shape), tuple([1] * (len(a.shape) - 1) + [min(a.shape[-1], 64)])) if a.shape else None
    boxes = itertools.chain(
        [head] if head is not None else [],  # slabs made as they are compared
        geometry.split_rowmajor(Box.whole(a.shape), max(1, slab_bytes // max(1, itemsize(a.dtype)))),
    )
    import torch

    for box in boxes:
        x, y = fetcher.fetch(a, box), fetcher.fetch(b, box)
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True
