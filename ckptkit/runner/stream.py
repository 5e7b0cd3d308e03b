"""Streaming a logical tensor as bytes, slab by slab, within a memory budget."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .. import interrupts
from ..index import geometry
from ..index.dtypes import itemsize, torch_dtype
from ..index.types import Box, TensorEntry
from .fetch import Fetcher

if TYPE_CHECKING:
    import torch
else:
    from ..lazy_torch import torch


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous tensor, without a copy."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def stream_tensor(fetcher: Fetcher, entry: TensorEntry, out_dtype: str | None, slab_bytes: int) -> Iterator[memoryview]:
    """Yield the tensor's row-major bytes (cast to out_dtype if given) in slabs of bounded size."""
    src_item = itemsize(entry.dtype)
    dst = torch_dtype(out_dtype) if out_dtype else None
    item = max(src_item, dst.itemsize if dst else 0)
    whole = Box.whole(entry.shape)
    if entry.numel == 0:
        return
    for slab in geometry.split_rowmajor(whole, max(1, slab_bytes // item)):
        interrupts.check()
        t = fetcher.fetch(entry, slab)
        if dst is not None and t.dtype != dst:
            t = t.to(dst)
        yield tensor_bytes(t)


def find_aliases(entries: dict[str, TensorEntry]) -> dict[str, str]:
    """Tensors that are the very same bytes as an earlier one (tied weights): alias -> target.
    Entries are first told apart by plain values (dtype, shape, where the first piece lies); the
    full signature (every piece's region and location, dataclasses slow to hash) is made only
    for those that share them."""
    seen: dict[tuple, str] = {}
    firsts: dict[tuple, tuple[str, TensorEntry] | None] = {}  # None: its signature is in seen
    aliases: dict[str, str] = {}
    for key, e in entries.items():
        if not e.pieces or e.numel == 0:
            continue
        loc = e.pieces[0].location
        near = (e.dtype, e.shape, len(e.pieces)) + ((loc.file, loc.offset) if loc is not None else (None, None))
        if near not in firsts:
            firsts[near] = (key, e)
            continue
        first = firsts[near]
        if first is not None:
            seen.setdefault(_signature(first[1]), first[0])
            firsts[near] = None
        sig = _signature(e)
        if sig in seen:
            aliases[key] = seen[sig]
        else:
            seen[sig] = key
    return aliases


def _signature(e: TensorEntry) -> tuple:
    return (e.dtype, e.shape, tuple((p.region, p.location) for p in e.pieces))
