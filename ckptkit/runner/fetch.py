"""Reading any region of a logical tensor from its pieces, with exact byte-range reads.

`Fetcher.fetch(entry, box)` plans, then executes the plan: runner/plan.py says which byte span of
which piece holds each part of `box` (pure, validated), and this module reads each span (one
positional read straight into place where both sides are one run of bytes), views it with the
piece's strides and copies it into place. A span larger than a window of the memory budget (a
strided piece, a transposed tensor) is read in windows, in the storage's own order. Compressed
items are decoded within bounds (runner/codecs): held whole when small, streamed through windows
when larger than the budget allows.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .. import interrupts
from ..errors import FormatError
from ..index import geometry
from ..index.dtypes import itemsize, torch_dtype
from ..index.types import Box, CheckpointIndex, Encoding, FlatRange, Piece, TensorEntry
from ..storage import kernel_copy
from ..storage.source import Source
from ..torch_types import SmallTensor
from .. import knobs
from . import codecs, limits
from .plan import Planner, ReadPlan, ReadSpan, check_tiling

if TYPE_CHECKING:
    import torch

    from ..storage.range_table import RangeTable
else:
    from ..lazy_torch import torch


@dataclass
class _Decoded:
    """A decoded compressed item: its tensor in memory, or the streamed item with the tensor's
    place in it (byte offset, strides)."""

    nbytes: int
    dtype: str
    size: tuple[int, ...]  # the item's tensor as it found it: every use checks these
    contiguous: bool
    tensor: "torch.Tensor | None" = None
    stream: Any = None
    offset: int = 0
    strides: tuple[int, ...] = ()


class Fetcher:
    """Reads tensor regions from one source. Thread-safe; caches a few decoded items (within a
    quarter of the memory budget)."""

    def __init__(
        self,
        source: Source,
        cache_items: int = 4,
        index: CheckpointIndex | None = None,
        memory_budget: int | None = None,
    ) -> None:
        self.source = source
        self.index = index  # resolves "ref" pieces of virtual tensors
        self.memory_budget = memory_budget or limits.budget()
        self._window = max(1 << 20, knobs.slab_bytes(self.memory_budget) // 2)  # bytes one read may hold
        self._cache: OrderedDict[tuple, _Decoded] = OrderedDict()
        self._cache_items = cache_items
        self._lock = threading.Lock()
        self._tiled: dict[int, TensorEntry] = {}  # keeps entries alive so ids stay unique
        self._planner = Planner(index, label=self._label, tiling=self.check_tiling)

    def check_tiling(self, entry: TensorEntry) -> None:
        """Refuse a tensor whose pieces do not cover it exactly once (plan.check_tiling), once
        per entry."""
        if id(entry) in self._tiled:
            return
        check_tiling(entry, self._label)
        if not entry.attrs.get("virtual"):  # one-use virtual tensors are not remembered
            with self._lock:
                self._tiled[id(entry)] = entry

    def plan(self, entry: TensorEntry, box: Box | None = None) -> ReadPlan:
        """The validated read plan of `box` (default: the whole tensor); reads nothing."""
        return self._planner(entry, box)

    def fetch(self, entry: TensorEntry, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The elements of `box` (default: the whole tensor), contiguous, in the entry's dtype:
        planned, then read."""
        interrupts.check()  # after a Ctrl-C, every writer stops at its next read
        plan = self.plan(entry, box)
        if out is None:
            out = torch.empty(plan.box.sizes, dtype=torch_dtype(entry.dtype))
        self._execute(plan, entry, out)
        return out

    def _execute(self, plan: ReadPlan, entry: TensorEntry, out: torch.Tensor) -> None:
        """Read every span of `plan` into its place in `out` (a tensor of the plan's box)."""
        for span in plan.spans:
            dst = out
            if span.box is not plan.box:  # (the planner hands the plan's own box to a span that fills it)
                for d, (o, bo, s) in enumerate(zip(span.box.offsets, plan.box.offsets, span.box.sizes)):
                    dst = dst.narrow(d, o - bo, s)
            encoding = span.encoding
            if encoding is Encoding.RAW:
                self._read_raw(entry, span, dst)
            elif encoding is Encoding.TORCH_SAVE:
                self._read_item(entry, span, dst)
            elif encoding is Encoding.ZEROS:
                dst.zero_()
            elif encoding is Encoding.REF:
                self._read_ref(span, dst)
            else:  # INLINE: the plan knows no other encoding
                value = entry.attrs["value"]
                if isinstance(value, SmallTensor):
                    value = value.to_torch()
                dst.copy_(_narrow(value, span.region, span.box))

    def _read_raw(self, entry: TensorEntry, span: ReadSpan, dst: torch.Tensor) -> None:
        """One read straight into `dst` when both sides are one run of bytes, else windows in
        the storage's order (a strided piece, a transposed tensor)."""
        if span.dense and dst.is_contiguous():
            self.source.readinto(span.file, span.offset, memoryview(dst.reshape(-1).view(torch.uint8).numpy()))
            return
        origin = entry.pieces[span.piece].location.offset

        def read(start: int, buf: memoryview) -> None:
            self.source.readinto(span.file, origin + start, buf)

        self._gather(read, span.base, span.strides, _local(span), dst)

    def _read_item(self, entry: TensorEntry, span: ReadSpan, dst: torch.Tensor) -> None:
        """Elements of a compressed item: narrowed from the decoded tensor when it is held in
        memory, else gathered window by window from the streamed item."""
        piece = entry.pieces[span.piece]
        decoded = self._decoded(entry, piece)
        if decoded.stream is None:
            view = decoded.tensor
            if span.strides is not None:  # a flat piece: its elements from span.base, row-major
                view = view.narrow(0, span.base, span.region.numel).reshape(span.region.sizes)
            dst.copy_(_narrow(view, span.region, span.box))
            return
        if span.strides is not None:
            strides, base = span.strides, span.base
        else:
            strides, base = decoded.strides, 0
        stream = decoded.stream

        def read(start: int, buf: memoryview) -> None:
            stream.readinto("", decoded.offset + start, buf)

        self._gather(read, base, strides, _local(span), dst)

    def _gather(
        self, read: Callable[[int, memoryview], None], base: int, strides: tuple[int, ...], box: Box, dst: torch.Tensor
    ) -> None:
        """Copy the elements of `box` of a strided view (element i at base + sum(i*strides)) into
        `dst`, reading the storage in order, one window of at most self._window bytes at a time
        (a transposed tensor's slab spans nearly its whole storage)."""
        item = dst.element_size()
        order = sorted(range(box.ndim), key=lambda d: -strides[d])  # the storage's own order
        pbox = Box(tuple(box.offsets[d] for d in order), tuple(box.sizes[d] for d in order))
        pstrides = tuple(strides[d] for d in order)
        pdst = dst.permute(order) if box.ndim else dst
        buf = bytearray(min(self._window, geometry.strided_span(pbox.sizes, pstrides) * item))
        for part in geometry.split_by_span(pbox, pstrides, max(1, self._window // item)):
            first = base + sum(o * st for o, st in zip(part.offsets, pstrides))
            span = geometry.strided_span(part.sizes, pstrides)
            window = memoryview(buf)[: span * item] if span * item <= len(buf) else memoryview(bytearray(span * item))
            read(first * item, window)
            src = (
                torch.frombuffer(window, dtype=dst.dtype, count=span).as_strided(part.sizes, pstrides)
                if span
                else torch.empty(part.sizes, dtype=dst.dtype)
            )
            target = pdst
            for d, (o, po, n) in enumerate(zip(part.offsets, pbox.offsets, part.sizes)):
                target = target.narrow(d, o - po, n)
            target.copy_(src)

    def _read_ref(self, span: ReadSpan, dst: torch.Tensor) -> None:
        """A virtual piece: the planned boxes of another logical tensor, in its flat order."""
        target = self.index.tensors[span.file]  # the plan resolved it
        flat = dst.reshape(-1) if dst.is_contiguous() else torch.empty(span.length, dtype=dst.dtype)
        same_dtype = flat.dtype == torch_dtype(target.dtype)
        pos = 0
        for ref in span.refs:
            interrupts.check()
            window = flat[pos : pos + ref.box.numel]
            if same_dtype:  # each box is contiguous in the flattening: read straight into place
                self._execute(ref, target, window.view(ref.box.sizes))
            else:
                part = torch.empty(ref.box.sizes, dtype=torch_dtype(target.dtype))
                self._execute(ref, target, part)
                window.copy_(part.reshape(-1))
            pos += ref.box.numel
        if not dst.is_contiguous():
            dst.copy_(flat.view(span.box.sizes))

    def read_small(self, entry: TensorEntry) -> "SmallTensor | torch.Tensor":
        """A small tensor (an optimizer step) whole: a SmallTensor read without torch where its
        bytes are stored plainly, else a torch tensor through fetch()."""
        ranges = self.byte_ranges(entry)
        if ranges is None:
            return self.fetch(entry)
        return SmallTensor(entry.dtype, tuple(entry.shape), kernel_copy.read(self.source, ranges))

    def byte_ranges(
        self, entry: TensorEntry, start: int = 0, length: int | None = None, dtype: str | None = None
    ) -> list[tuple[str | bytes | None, int, int]] | None:
        """Elements [start, start+length) of the entry's flattening as raw source byte ranges
        (file, offset, nbytes), or (None, 0, nbytes) for zero padding, or (bytes, offset,
        nbytes) for a small tensor held in memory, in order: a view of the read plan
        (plan.plan_byte_ranges). None when the bytes are not stored that simply (strided,
        encoded, another dtype): callers then fall back to fetch(). Lets writers copy bytes in
        the kernel instead of through Python."""
        if (dtype or entry.dtype) != entry.dtype:
            return None
        return self._planner.byte_ranges(entry, start, length)

    def ranges(self, entry: TensorEntry) -> RangeTable | list[tuple[str | bytes | None, int, int]] | None:
        """The whole entry's byte ranges: a flat table's as arrays (range_table), else as
        byte_ranges lists them; its table planned once either way. None as byte_ranges."""
        return self._planner.ranges(entry)

    def range_table(self, entry: TensorEntry) -> RangeTable | None:
        """byte_ranges of a whole flat table (index/virtual.FlatTable: a ZeRO partition) as
        arrays (storage/range_table), or None: not a table, or not stored that simply (then
        byte_ranges, or fetch())."""
        return self._planner.range_table(entry)

    def _label(self, rel: str) -> str:
        return self.source.label(rel)

    def _decoded(self, entry: TensorEntry, piece: Piece) -> _Decoded:
        """A compressed item decoded within bounds (its declared bytes plus the archive around
        them): in memory when small, else streamed; cached within a quarter of the budget. Every
        use, a cached one too, checks the item against what this entry's metadata says of it (two
        storage records may name the same bytes)."""
        loc = piece.location
        flat = isinstance(piece.region, FlatRange)
        key = (loc.file, loc.offset, loc.length, loc.transforms, flat)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is not None:
            _check_item(hit, entry, piece, self.source)
            return hit
        from .torch_archive import item_tensor, open_item

        label = _item_label(self.source, entry, piece)
        declared = piece.region.numel * itemsize(entry.dtype)
        item = codecs.open_decoded(
            self.source,
            loc.file,
            loc.offset,
            loc.length,
            loc.transforms,
            label,
            codecs.tensor_limit(declared),
            limits.inline_bytes(self.memory_budget),
        )
        found = item_tensor(open_item(item, label), "item")  # CRC32s checked (streamed: in windows)
        if found is None:
            raise FormatError(f"{label}: does not hold a tensor")
        ref, dtype, inner = found
        size = tuple(ref.size)
        strides = inner.stride or geometry.row_major_strides(size)
        checked = _Decoded(item.nbytes, dtype, size, inner.stride is None)
        _check_item(checked, entry, piece, self.source)
        if isinstance(item, codecs.StreamedItem):
            decoded = replace(checked, stream=item, offset=inner.offset, strides=tuple(strides))
        else:
            tdtype = torch_dtype(dtype)
            whole = (
                torch.frombuffer(item.data, dtype=tdtype, count=inner.length // tdtype.itemsize, offset=inner.offset)
                if inner.length
                else torch.empty(0, dtype=tdtype)
            )
            tensor = whole.as_strided(size, strides)
            decoded = replace(checked, tensor=tensor.reshape(-1) if flat else tensor)
        with self._lock:
            self._cache[key] = decoded
            held = sum(d.nbytes for d in self._cache.values())
            while len(self._cache) > 1 and (len(self._cache) > self._cache_items or held > self.memory_budget // 4):
                _, old = self._cache.popitem(last=False)
                held -= old.nbytes
                if old.stream is not None:
                    old.stream.close()
        return decoded


def _item_label(source: Source, entry: TensorEntry, piece: Piece) -> str:
    return f"{source.label(piece.location.file)} (item of {entry.key})"


def _check_item(item: _Decoded, entry: TensorEntry, piece: Piece, source: Source) -> None:
    """The decoded item holds what the metadata says of this piece: its dtype, and its shape (a
    box) or element count, stored contiguous (a flat range). (Called for every use of a cached
    item: its message is worded only for a refusal.)"""
    region = piece.region
    if item.dtype != entry.dtype:
        raise FormatError(f"{_item_label(source, entry, piece)}: holds {item.dtype}, metadata says {entry.dtype}")
    if isinstance(region, Box) and item.size != region.sizes:
        raise FormatError(f"{_item_label(source, entry, piece)}: has shape {item.size}, metadata says {region.sizes}")
    if isinstance(region, FlatRange) and (math.prod(item.size) != region.numel or not item.contiguous):
        raise FormatError(
            f"{_item_label(source, entry, piece)}: holds {list(item.size)} elements, metadata says "
            f"a contiguous {region.numel}"
        )


def _narrow(view: torch.Tensor, region: Box, box: Box) -> torch.Tensor:
    """The elements of `box` from a tensor holding `region`."""
    for d, (o, so, s) in enumerate(zip(box.offsets, region.offsets, box.sizes)):
        view = view.narrow(d, o - so, s)
    return view


def _local(span: ReadSpan) -> Box:
    """The span's elements relative to the region holding them."""
    return Box(tuple(o - so for o, so in zip(span.box.offsets, span.region.offsets)), span.box.sizes)
