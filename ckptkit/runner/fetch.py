"""Reading any region of a logical tensor from its pieces, with exact byte-range reads.

`Fetcher.fetch(entry, box)` assembles a contiguous tensor for `box` from whichever pieces
overlap it: for each overlap it reads only the byte span that holds those elements (one
positional read), views it with the piece's strides and copies it into place. A span larger than
a window of the memory budget (a strided piece, a transposed tensor) is read in windows, in the
storage's own order. Compressed items are decoded within bounds (runner/codecs): held whole when
small, streamed through windows when larger than the budget allows.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import interrupts
from ..errors import FormatError
from ..index import geometry
from ..index.dtypes import itemsize, torch_dtype
from ..index.types import Box, CheckpointIndex, FlatRange, Piece, TensorEntry
from ..index.virtual import INLINE, REF, ZEROS
from ..storage import kernel_copy
from ..storage.source import Source
from ..torch_types import SmallTensor
from .. import knobs
from . import codecs, limits

if TYPE_CHECKING:
    import torch
else:
    from ..lazy_torch import torch


@dataclass
class _Decoded:
    """A decoded compressed item: its tensor in memory, or the streamed item with the tensor's
    place in it (byte offset, strides)."""

    nbytes: int
    tensor: "torch.Tensor | None" = None
    stream: Any = None
    offset: int = 0
    strides: tuple[int, ...] = ()


class Fetcher:
    """Reads tensor regions from one source. Thread-safe; caches a few decoded items (within a
    quarter of the memory budget)."""

    def __init__(self, source: Source, cache_items: int = 4, index: CheckpointIndex | None = None,
                 memory_budget: int | None = None) -> None:
        self.source = source
        self.index = index  # resolves "ref" pieces of virtual tensors
        self.memory_budget = memory_budget or limits.budget()
        self._window = max(1 << 20, knobs.slab_bytes(self.memory_budget) // 2)  # bytes one read may hold
        self._cache: OrderedDict[tuple, _Decoded] = OrderedDict()
        self._cache_items = cache_items
        self._lock = threading.Lock()
        self._tiled: dict[int, TensorEntry] = {}  # keeps entries alive so ids stay unique

    def check_tiling(self, entry: TensorEntry) -> None:
        """Refuse a tensor whose pieces do not cover it exactly once.

        Counting filled elements is not enough (a doubled row and a missing row add up), and a
        gap would otherwise leave uninitialised memory in the output.
        """
        if id(entry) in self._tiled:
            return
        cov = geometry.coverage(entry.shape, [p.region for p in entry.pieces], max_report=1)
        if not cov.exact:
            if cov.out_of_bounds:
                why = "a piece lies outside the tensor"
            elif cov.missing:
                b = cov.missing[0]
                why = f"{cov.missing_elements} element(s) are in no piece (e.g. offsets {list(b.offsets)} sizes {list(b.sizes)})"
            else:
                b = cov.doubled[0]
                why = f"elements are stored twice (e.g. offsets {list(b.offsets)} sizes {list(b.sizes)})"
            raise FormatError(f"{self.source.label('')}: tensor {entry.key} {list(entry.shape)} is not "
                              f"tiled exactly by its pieces: {why}; run `ckptkit verify` for all problems")
        if not entry.attrs.get("virtual"):  # one-use virtual tensors are not remembered
            with self._lock:
                self._tiled[id(entry)] = entry

    def fetch(self, entry: TensorEntry, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The elements of `box` (default: the whole tensor), contiguous, in the entry's dtype."""
        interrupts.check()  # after a Ctrl-C, every writer stops at its next read
        self.check_tiling(entry)
        box = box or Box.whole(entry.shape)
        dtype = torch_dtype(entry.dtype)
        if out is None:
            out = torch.empty(box.sizes, dtype=dtype)
        filled = 0
        for piece in entry.pieces:
            for sub, elem_offset in geometry.region_boxes(piece.region, entry.shape):
                inter = geometry.intersect(sub, box)
                if inter is None:
                    continue
                dst = out
                for d, (o, s) in enumerate(zip(inter.offsets, inter.sizes)):
                    dst = dst.narrow(d, o - box.offsets[d], s)
                if not self._read_direct(entry, piece, sub, elem_offset, inter, dst):
                    dst.copy_(self._read(entry, piece, sub, elem_offset, inter))
                filled += inter.numel
        if filled != box.numel:
            raise FormatError(
                f"{self.source.label('')}: tensor {entry.key} region {list(box.offsets)}+{list(box.sizes)} "
                f"is not covered by its pieces ({filled} of {box.numel} elements found)")
        return out

    def _span(self, entry: TensorEntry, piece: Piece, sub: Box, elem_offset: int,
              inter: Box) -> tuple[int, int, tuple[int, ...]]:
        """(first element, last element, strides) of `inter` inside the piece's raw bytes."""
        loc = piece.location
        if isinstance(piece.region, FlatRange) or loc.stride is None:
            strides = geometry.row_major_strides(sub.sizes)
        else:
            strides = loc.stride
        local = [o - so for o, so in zip(inter.offsets, sub.offsets)]
        first = elem_offset + sum(l * st for l, st in zip(local, strides))
        last = first + sum((s - 1) * st for s, st in zip(inter.sizes, strides))
        item = itemsize(entry.dtype)
        if inter.numel and (first < 0 or (last + 1) * item > loc.length):
            raise FormatError(f"{self.source.label(loc.file)}: tensor {entry.key} reads past its recorded byte range")
        return first, last, tuple(strides)

    def _read_direct(self, entry: TensorEntry, piece: Piece, sub: Box, elem_offset: int,
                     inter: Box, dst: torch.Tensor) -> bool:
        """Read straight into `dst`: one read when both sides are one contiguous run of bytes,
        windows in storage order for a strided piece or a streamed compressed item; virtual
        pieces (zeros, a flat range of another tensor, an inline value) are filled in place.
        False for a compressed item held in memory (_read narrows it)."""
        encoding = piece.location.encoding
        if encoding == ZEROS:
            dst.zero_()
            return True
        if encoding == REF:
            self._read_ref(entry, piece, sub, elem_offset, inter, dst)
            return True
        if encoding == INLINE:
            value = entry.attrs["value"]
            if isinstance(value, SmallTensor):
                value = value.to_torch()
            for d, (o, so, s) in enumerate(zip(inter.offsets, sub.offsets, inter.sizes)):
                value = value.narrow(d, o - so, s)
            dst.copy_(value)
            return True
        if encoding == "torch_save":
            decoded = self._decoded(entry, piece)
            if decoded.stream is None:
                return False  # held in memory: _read narrows it
            self._gather_streamed(entry, piece, decoded, sub, elem_offset, inter, dst)
            return True
        if encoding != "raw" or not inter.numel:
            return False
        first, _last, strides = self._span(entry, piece, sub, elem_offset, inter)  # bounds-checked
        loc = piece.location
        item = dst.element_size()
        dense = geometry.row_major_strides(inter.sizes)
        if dst.is_contiguous() and all(n == 1 or st == want for n, st, want in zip(inter.sizes, strides, dense)):
            view = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
            self.source.readinto(loc.file, loc.offset + first * item, view)
            return True
        local = Box(tuple(o - so for o, so in zip(inter.offsets, sub.offsets)), inter.sizes)

        def read(start: int, buf: memoryview) -> None:
            self.source.readinto(loc.file, loc.offset + start, buf)

        self._gather(read, elem_offset, strides, local, dst)
        return True

    def _gather(self, read: Callable[[int, memoryview], None], base: int, strides: tuple[int, ...],
                box: Box, dst: torch.Tensor) -> None:
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
            window = memoryview(buf)[:span * item] if span * item <= len(buf) else memoryview(bytearray(span * item))
            read(first * item, window)
            src = torch.frombuffer(window, dtype=dst.dtype, count=span).as_strided(part.sizes, pstrides) \
                if span else torch.empty(part.sizes, dtype=dst.dtype)
            target = pdst
            for d, (o, po, n) in enumerate(zip(part.offsets, pbox.offsets, part.sizes)):
                target = target.narrow(d, o - po, n)
            target.copy_(src)

    def _gather_streamed(self, entry: TensorEntry, piece: Piece, decoded: _Decoded, sub: Box, elem_offset: int,
                         inter: Box, dst: torch.Tensor) -> None:
        """Elements of `inter` from a streamed compressed item, window by window."""
        local = Box(tuple(o - so for o, so in zip(inter.offsets, sub.offsets)), inter.sizes)
        if isinstance(piece.region, FlatRange):  # the item holds the piece's elements in row-major order
            strides, base = geometry.row_major_strides(sub.sizes), elem_offset
        else:
            strides, base = decoded.strides, 0
        stream = decoded.stream

        def read(start: int, buf: memoryview) -> None:
            stream.readinto("", decoded.offset + start, buf)

        self._gather(read, base, strides, local, dst)

    def read_small(self, entry: TensorEntry) -> "SmallTensor | torch.Tensor":
        """A small tensor (an optimizer step) whole: a SmallTensor read without torch where its
        bytes are stored plainly, else a torch tensor through fetch()."""
        ranges = self.byte_ranges(entry)
        if ranges is None:
            return self.fetch(entry)
        return SmallTensor(entry.dtype, tuple(entry.shape), kernel_copy.read(self.source, ranges))

    def byte_ranges(self, entry: TensorEntry, start: int = 0, length: int | None = None,
                    dtype: str | None = None) -> list[tuple[str | bytes | None, int, int]] | None:
        """Elements [start, start+length) of the entry's flattening as raw source byte ranges
        (file, offset, nbytes), or (None, 0, nbytes) for zero padding, or (bytes, offset,
        nbytes) for a small tensor held in memory, in order. None when the
        bytes are not stored that simply (strided, encoded, another dtype): callers then fall
        back to fetch(). Lets writers copy bytes in the kernel instead of through Python."""
        dtype = dtype or entry.dtype
        if dtype != entry.dtype:
            return None
        self.check_tiling(entry)  # the same refusal fetch() gives: never copy a doubled or gappy tensor
        item = itemsize(entry.dtype)
        length = entry.numel - start if length is None else length
        spans: list[tuple[int, int, Piece]] = []
        for piece in entry.pieces:
            region, loc = piece.region, piece.location
            if isinstance(region, FlatRange):
                a, n = region.start, region.length
            elif (region.ndim and region.sizes[1:] == tuple(entry.shape[1:]) and not any(region.offsets[1:])
                  and (loc.stride is None or loc.encoding != "raw")):
                inner = math.prod(entry.shape[1:])  # a dim-0 chunk is a flat range
                a, n = region.offsets[0] * inner, region.sizes[0] * inner
            elif region.sizes == tuple(entry.shape) and (loc.stride is None or loc.encoding != "raw"):
                a, n = 0, entry.numel
            else:
                return None
            if loc.encoding == INLINE and not isinstance(entry.attrs.get("value"), SmallTensor):
                return None
            if loc.encoding not in ("raw", REF, ZEROS, INLINE) or (loc.encoding == "raw" and loc.stride is not None
                                                                  and isinstance(region, Box)):
                return None
            spans.append((a, n, piece))
        spans.sort(key=lambda s: s[0])
        out: list[tuple[str | None, int, int]] = []
        pos, end = start, start + length
        for a, n, piece in spans:
            lo, hi = max(pos, a), min(end, a + n)
            if hi <= lo:
                continue
            if lo != pos:
                return None  # a gap: let fetch() report it
            loc = piece.location
            if loc.encoding == ZEROS:
                out.append((None, 0, (hi - lo) * item))
            elif loc.encoding == INLINE:
                out.append((entry.attrs["value"].data, (lo - a) * item, (hi - lo) * item))
            elif loc.encoding == REF:
                if self.index is None or loc.file not in self.index.tensors:
                    return None
                inner = self.byte_ranges(self.index.tensors[loc.file], loc.offset + (lo - a), hi - lo, dtype)
                if inner is None:
                    return None
                out.extend(inner)
            else:
                out.append((loc.file, loc.offset + (lo - a) * item, (hi - lo) * item))
            pos = hi
        return out if pos == end else None

    def _read_ref(self, entry: TensorEntry, piece: Piece, sub: Box, elem_offset: int, inter: Box,
                  dst: torch.Tensor) -> None:
        """A virtual piece: elements of another logical tensor's row-major flattening."""
        if self.index is None or piece.location.file not in self.index.tensors:
            raise FormatError(f"virtual tensor {entry.key} refers to unknown tensor {piece.location.file!r}")
        target = self.index.tensors[piece.location.file]
        # position of inter's first element inside the piece, then inside the referenced tensor
        strides = geometry.row_major_strides(sub.sizes)
        local = [o - so for o, so in zip(inter.offsets, sub.offsets)]
        first = elem_offset + sum(l * st for l, st in zip(local, strides))
        start = piece.location.offset + first
        if start + inter.numel > target.numel:
            raise FormatError(f"virtual tensor {entry.key} reads past the end of {target.key}")
        flat = dst.reshape(-1) if dst.is_contiguous() else torch.empty(inter.numel, dtype=dst.dtype)
        same_dtype = flat.dtype == torch_dtype(target.dtype)
        pos = 0
        for box, _ in geometry.flat_to_boxes(FlatRange(start, inter.numel), target.shape):
            window = flat[pos:pos + box.numel]
            if same_dtype:  # each box is contiguous in the flattening: read straight into place
                self.fetch(target, box, out=window.view(box.sizes))
            else:
                window.copy_(self.fetch(target, box).reshape(-1))
            pos += box.numel
        if not dst.is_contiguous():
            dst.copy_(flat.view(inter.sizes))

    def _read(self, entry: TensorEntry, piece: Piece, sub: Box, elem_offset: int, inter: Box) -> torch.Tensor:
        loc = piece.location
        if loc.encoding == "torch_save":
            decoded = self._decoded(entry, piece)
            view = decoded.tensor
            if isinstance(piece.region, FlatRange):  # the piece's elements from elem_offset, row-major
                view = view.narrow(0, elem_offset, sub.numel).reshape(sub.sizes)
            return _narrow(view, sub, inter)
        raise FormatError(f"{self.source.label(loc.file)}: unknown piece encoding {loc.encoding!r}")

    def _decoded(self, entry: TensorEntry, piece: Piece) -> _Decoded:
        """A compressed item decoded within bounds (its declared bytes plus the archive around
        them): in memory when small, else streamed; cached within a quarter of the budget."""
        loc = piece.location
        key = (loc.file, loc.offset)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        from ..formats.torch_save.archive import item_tensor, open_item

        label = f"{self.source.label(loc.file)} (item of {entry.key})"
        declared = piece.region.numel * itemsize(entry.dtype)
        item = codecs.open_decoded(self.source, loc.file, loc.offset, loc.length, loc.transforms, label,
                                   codecs.tensor_limit(declared), limits.inline_bytes(self.memory_budget))
        found = item_tensor(open_item(item, label), "item")  # CRC32s checked (streamed: in windows)
        if found is None:
            raise FormatError(f"{label}: does not hold a tensor")
        ref, dtype, inner = found
        size = tuple(ref.size)
        if dtype != entry.dtype:
            raise FormatError(f"{label}: holds {dtype}, metadata says {entry.dtype}")
        if isinstance(piece.region, Box) and size != piece.region.sizes:
            raise FormatError(f"{label}: has shape {size}, metadata says {piece.region.sizes}")
        if isinstance(piece.region, FlatRange) and (math.prod(size) != piece.region.numel or inner.stride is not None):
            raise FormatError(f"{label}: holds {list(size)} elements, metadata says a contiguous "
                              f"{piece.region.numel}")
        strides = inner.stride or geometry.row_major_strides(size)
        if isinstance(item, codecs.StreamedItem):
            decoded = _Decoded(item.nbytes, stream=item, offset=inner.offset, strides=tuple(strides))
        else:
            tdtype = torch_dtype(dtype)
            flat = torch.frombuffer(item.data, dtype=tdtype, count=inner.length // tdtype.itemsize,
                                    offset=inner.offset) if inner.length else torch.empty(0, dtype=tdtype)
            tensor = flat.as_strided(size, strides)
            decoded = _Decoded(item.nbytes, tensor=tensor.reshape(-1) if isinstance(piece.region, FlatRange)
                               else tensor)
        with self._lock:
            self._cache[key] = decoded
            held = sum(d.nbytes for d in self._cache.values())
            while len(self._cache) > 1 and (len(self._cache) > self._cache_items or held > self.memory_budget // 4):
                _, old = self._cache.popitem(last=False)
                held -= old.nbytes
                if old.stream is not None:
                    old.stream.close()
        return decoded


def _narrow(view: torch.Tensor, sub: Box, inter: Box) -> torch.Tensor:
    for d, (o, so, s) in enumerate(zip(inter.offsets, sub.offsets, inter.sizes)):
        view = view.narrow(d, o - so, s)
    return view
