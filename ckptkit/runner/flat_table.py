"""Byte ranges of a FlatTable (a ZeRO partition described as arrays), computed on arrays.

A FlatTable's part i is a flat range of tensor refs[i], a parameter stored as a few flat runs of
the source ranks' files. `SourceRuns` turns each referenced tensor into rows of arrays once
(its runs: start, length, file, byte offset), checked as flat_plan's sweep checks them: flat
runs in order tiling the tensor, raw bytes inside each piece's recorded bytes (and file). A
table's byte ranges are then one vectorised intersection of its parts with their tensors' runs,
the zero padding between them, and adjacent ranges of a file merged: the same ranges, in the
same order, that flat_plan gives for the pieces the table stands for (tests/test_flat_table.py).
Anything else (a reference to a tensor not stored that simply, another dtype, a read past a
tensor's end) answers None, and the caller plans the table's pieces as before, which gives the
same bytes or the same refusal.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from itertools import chain, repeat
from operator import attrgetter, contains

import numpy as np

from ..index.dtypes import itemsize
from ..index.types import Box, Encoding, FlatRange, TensorEntry
from ..index.virtual import FlatTable
from ..storage.range_table import RangeTable

__all__ = ["SourceRuns", "table_ranges"]

_RAW = Encoding.RAW
_ATTRS, _DTYPE, _PIECES, _SHAPE = (attrgetter(a) for a in ("attrs", "dtype", "pieces", "shape"))
_REGION, _LOCATION, _START, _LENGTH = (attrgetter(a) for a in ("region", "location", "start", "length"))
_ENCODING, _FILE, _OFFSET = (attrgetter(a) for a in ("encoding", "file", "offset"))


class SourceRuns:
    """The flat runs of the tensors flat tables refer to, as arrays: each tensor turned into rows
    once, when a table first refers to it (thread-safe: a Fetcher's workers share it)."""

    def __init__(self, tensors: Mapping[str, TensorEntry], file_sizes: Mapping[str, int] | None = None) -> None:
        self._tensors, self._file_sizes = tensors, file_sizes
        self._lock = threading.Lock()
        self._row_of: dict[str, int] = {}  # key -> row, -1 where its runs are not simple
        self._first: list[int] = []  # per row: its first run, its run count, numel, dtype
        self._count: list[int] = []
        self._numel: list[int] = []
        self._dtype: list[int] = []
        self._dtypes: dict[str, int] = {}
        self._start: list[int] = []  # per run: first element, elements, file, byte offset
        self._length: list[int] = []
        self._file: list[int] = []
        self._offset: list[int] = []
        self.files: list[str] = []
        self._file_id: dict[str, int] = {}
        self._arrays: tuple[np.ndarray, ...] | None = None
        self._rows: dict[int, tuple[list[str], np.ndarray]] = {}  # id(refs) -> (refs, rows)

    def resolve(self, refs: list[str]) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """The rows of `refs` (-1: not simple) and the arrays (per row: first run, run count,
        numel, dtype code; per run: start, length, file, offset) that hold them."""
        with self._lock:
            hit = self._rows.get(id(refs))
            if hit is not None and hit[0] is refs:
                rows = hit[1]
            else:
                row_of = self._row_of
                new = [k for k in refs if k not in row_of]
                if new:
                    self._register_all(new)
                rows = np.fromiter(map(row_of.__getitem__, refs), dtype=np.int64, count=len(refs))
                self._rows[id(refs)] = (refs, rows)  # the list is kept, so its id stays its own
            if self._arrays is None:
                self._arrays = tuple(
                    np.array(col, dtype=np.int64)
                    for col in (
                        self._first,
                        self._count,
                        self._numel,
                        self._dtype,
                        self._start,
                        self._length,
                        self._file,
                        self._offset,
                    )
                )
            return rows, self._arrays

    def dtype_code(self, dtype: str) -> int:
        return self._dtypes.setdefault(dtype, len(self._dtypes))

    def _register_all(self, keys: list[str]) -> None:
        """_register each key; the usual tensor (a ZeRO parameter: flat runs in order, raw, inside
        their pieces' bytes, nothing empty) in one tight pass, anything else through _register.
        A batch of nothing but usual tensors (a ZeRO partition's 20k parameters) is checked and
        added on arrays at once (_register_usual)."""
        if not self._register_usual(keys):
            self._register_each(keys)
        self._arrays = None

    def _register_usual(self, keys: list[str]) -> bool:
        """_register_each's outcome for `keys` when every one of them is the usual tensor, its
        checks made on arrays (the same checks, each over the whole batch); False, having
        registered nothing, when any key is not (then _register_each sorts them one by one)."""
        tensors, sizes = self._tensors, self._file_sizes
        if sizes is not None or not keys or len(set(keys)) != len(keys):
            return False
        entries = list(map(tensors.get, keys))
        if type(None) in set(map(type, entries)) or any(map(contains, map(_ATTRS, entries), repeat("virtual"))):
            return False
        items: dict[str, int] = {}
        dtypes = list(map(_DTYPE, entries))
        for dtype in dict.fromkeys(dtypes):
            try:
                items[dtype] = itemsize(dtype)
            except (KeyError, ValueError):
                return False
        lists = list(map(_PIECES, entries))
        pieces = list(chain.from_iterable(lists))
        regions = list(map(_REGION, pieces))
        locs = list(map(_LOCATION, pieces))
        if set(map(type, regions)) - {FlatRange} or set(map(_ENCODING, locs)) - {_RAW}:
            return False
        counts = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        starts, lengths, loc_lengths, numels = (
            _ints(v)
            for v in (
                list(map(_START, regions)),
                list(map(_LENGTH, regions)),
                list(map(_LENGTH, locs)),
                [shape[0] if len(shape) == 1 else math.prod(shape) for shape in map(_SHAPE, entries)],
            )
        )
        if starts is None or lengths is None or loc_lengths is None or numels is None:
            return False
        item = np.repeat(np.array([items[d] for d in dtypes], dtype=np.int64), counts)
        if float(np.abs(lengths).sum(dtype=np.float64)) >= 2.0**62:  # (sums below: no int64 overflow)
            return False
        # each entry's runs tile it in order: a run starts where the entry's runs before it end
        ends = np.cumsum(lengths)
        firsts = np.cumsum(counts) - counts  # each entry's first run
        held = counts > 0
        base = np.repeat((ends - lengths)[firsts[held]], counts[held])  # its runs' sum before the entry
        totals = np.zeros(len(entries), dtype=np.int64)
        totals[held] = ends[firsts[held] + counts[held] - 1] - (ends - lengths)[firsts[held]]
        if not (
            bool((lengths > 0).all())
            and bool((starts == ends - lengths - base).all())
            and bool((lengths <= loc_lengths // item).all())
            and bool((totals == numels).all())
        ):
            return False
        files, file_id = self.files, self._file_id
        rels = list(map(_FILE, locs))
        for rel in dict.fromkeys(rels):
            if rel not in file_id:
                file_id[rel] = len(files)
                files.append(rel)
        codes = self._dtypes
        code_of = {dtype: codes[dtype] if dtype in codes else self.dtype_code(dtype) for dtype in items}
        row = len(self._first)
        self._row_of.update(zip(keys, range(row, row + len(keys))))
        self._first.extend((firsts + len(self._start)).tolist())
        self._count.extend(counts.tolist())
        self._numel.extend(numels.tolist())
        self._dtype.extend(map(code_of.__getitem__, dtypes))
        self._start.extend(starts.tolist())
        self._length.extend(lengths.tolist())
        self._file.extend(map(file_id.__getitem__, rels))
        self._offset.extend(map(_OFFSET, locs))
        return True

    def _register_each(self, keys: list[str]) -> None:
        """_register_all one key at a time."""
        tensors, row_of, items, codes = self._tensors, self._row_of, {}, self._dtypes
        first, count, numel_of, dtype_of = self._first, self._count, self._numel, self._dtype
        start_of, length_of, file_of, offset_of = self._start, self._length, self._file, self._offset
        file_id, files = self._file_id, self.files
        sizes = self._file_sizes
        for key in keys:
            if key in row_of:
                continue
            entry = tensors.get(key)
            if entry is None or sizes is not None or "virtual" in entry.attrs:
                self._register(key)
                continue
            dtype = entry.dtype
            item = items.get(dtype)
            if item is None:
                try:
                    item = items[dtype] = itemsize(dtype)
                except (KeyError, ValueError):
                    self._register(key)
                    continue
            runs = []
            pos = 0
            for piece in entry.pieces:
                region = piece.region
                if type(region) is not FlatRange or region.start != pos:
                    break
                length = region.length
                loc = piece.location
                if length <= 0 or loc.encoding != _RAW or length * item > loc.length:
                    break
                runs.append((pos, length, loc.file, loc.offset))
                pos += length
            else:
                shape = entry.shape
                numel = shape[0] if len(shape) == 1 else math.prod(shape)
                if pos == numel:
                    row_of[key] = len(first)
                    first.append(len(start_of))
                    count.append(len(runs))
                    numel_of.append(numel)
                    code = codes.get(dtype)
                    dtype_of.append(code if code is not None else self.dtype_code(dtype))
                    for start, length, rel, offset in runs:
                        f = file_id.get(rel)
                        if f is None:
                            f = file_id[rel] = len(files)
                            files.append(rel)
                        start_of.append(start)
                        length_of.append(length)
                        file_of.append(f)
                        offset_of.append(offset)
                    continue
            self._register(key)  # not the usual: the general checks

    def _register(self, key: str) -> int:
        """Key's row: its flat runs in order, or -1 where they are not what flat_plan's sweep
        reads simply (then the caller's planner answers, or refuses)."""
        runs = self._runs(self._tensors.get(key))
        if runs is None:
            self._row_of[key] = -1
            return -1
        entry, item, ordered = runs
        row = len(self._first)
        self._row_of[key] = row
        self._first.append(len(self._start))
        self._count.append(len(ordered))
        self._numel.append(entry.numel)
        self._dtype.append(self.dtype_code(entry.dtype))
        file_id = self._file_id
        for start, length, rel, offset in ordered:
            f = file_id.get(rel)
            if f is None:
                f = file_id[rel] = len(self.files)
                self.files.append(rel)
            self._start.append(start)
            self._length.append(length)
            self._file.append(f)
            self._offset.append(offset)
        self._arrays = None
        return row

    def _runs(self, entry: TensorEntry | None) -> tuple[TensorEntry, int, list[tuple[int, int, str, int]]] | None:
        """The entry's non-empty runs (start, length, file, byte offset) sorted by start, tiling
        it, each raw and inside its piece's recorded bytes (and its file); None otherwise."""
        if entry is None or entry.attrs.get("virtual"):
            return None
        try:
            item = itemsize(entry.dtype)
        except (KeyError, ValueError):
            return None
        shape = tuple(entry.shape)
        one_d = len(shape) == 1
        numel = entry.numel
        sizes = self._file_sizes
        out = []
        in_order, pos = True, 0
        for piece in entry.pieces:
            region, loc = piece.region, piece.location
            if type(region) is FlatRange:
                start, length = region.start, region.length
            elif type(region) is Box and (
                (one_d and len(region.sizes) == 1) or (region.sizes == shape and not any(region.offsets))
            ):
                if loc.stride is not None:
                    return None
                start, length = (region.offsets[0] if one_d else 0), region.sizes[0] if one_d else numel
            else:
                return None
            if length <= 0:
                if length < 0 or start < 0 or start > numel:
                    return None
                continue
            if (
                loc.encoding != _RAW
                or length * item > loc.length
                or (sizes is not None and sizes.get(loc.file, loc.offset + length * item) < loc.offset + length * item)
            ):
                return None
            in_order = in_order and start == pos
            pos = start + length
            out.append((start, length, loc.file, loc.offset))
        if not in_order:
            out.sort(key=lambda r: r[0])
            pos = 0
            for start, length, _, _ in out:
                if start != pos:
                    return None
                pos = start + length
        return (entry, item, out) if pos == numel else None


def _ints(values: list) -> np.ndarray | None:
    """`values` as an int64 array, None unless every one is an int that fits (then the checks
    on Python ints decide)."""
    if set(map(type, values)) - {int}:
        return None
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return None


def table_ranges(table: FlatTable, dtype: str, runs: SourceRuns) -> RangeTable | None:
    """The table's elements (of `dtype`) as coalesced byte ranges, or None where a part's tensor
    is not stored simply, has another dtype, or ends before the part."""
    item = itemsize(dtype)
    starts, lengths, positions = table.starts, table.lengths, table.positions
    rows, (first, count, numel, dtypes, run_start, run_length, run_file, run_offset) = runs.resolve(table.refs)
    if len(rows) and (
        bool((rows < 0).any())
        or bool((dtypes[rows] != runs.dtype_code(dtype)).any())
        or bool((starts + lengths > numel[rows]).any())
    ):
        return None
    # every (part, run of its tensor) pair, in order; the overlapping ones are the reads
    counts = count[rows]
    part = np.repeat(np.arange(len(rows), dtype=np.int64), counts)
    run = np.repeat(first[rows] - (np.cumsum(counts) - counts), counts) + np.arange(len(part), dtype=np.int64)
    lo = np.maximum(starts[part], run_start[run])
    hi = np.minimum((starts + lengths)[part], run_start[run] + run_length[run])
    keep = hi > lo
    part, run, lo, hi = part[keep], run[keep], lo[keep], hi[keep]
    at = positions[part] + (lo - starts[part])
    fids = run_file[run]
    offsets = run_offset[run] + (lo - run_start[run]) * item
    nbytes = (hi - lo) * item
    # zero padding: before each part, and after the last one to the end
    ends = np.concatenate(([0], positions + lengths))
    gaps = np.concatenate((positions, [table.numel])) - ends
    padded = gaps > 0
    if padded.any():
        at = np.concatenate((at, ends[padded]))
        fids = np.concatenate((fids, np.full(int(padded.sum()), -1, dtype=np.int64)))
        offsets = np.concatenate((offsets, np.zeros(int(padded.sum()), dtype=np.int64)))
        nbytes = np.concatenate((nbytes, gaps[padded] * item))
        order = np.argsort(at, kind="stable")
        fids, offsets, nbytes = fids[order], offsets[order], nbytes[order]
    # a range continuing the last in the same file (zeros after zeros) is merged into it
    if len(nbytes) > 1:
        merge = (fids[1:] == fids[:-1]) & ((fids[1:] < 0) | (offsets[:-1] + nbytes[:-1] == offsets[1:]))
        heads = np.flatnonzero(np.concatenate(([True], ~merge)))
        fids, offsets, nbytes = fids[heads], offsets[heads], np.add.reduceat(nbytes, heads)
    return RangeTable(runs.files, fids, offsets, nbytes)
