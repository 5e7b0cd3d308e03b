"""Byte ranges as arrays, and their bytes gathered a window at a time.

A ZeRO partition written at a new world size is hundreds of thousands of byte ranges of a few
dozen bytes each (a parameter's slice of a source rank's buffer). As a list of tuples each range
costs a tuple, a read of its block, a slice, a CRC update and an append in Python (kernel_copy);
as arrays (file, offset, length) the bytes of a window of ranges are gathered in one numpy
indexing from the few blocks of the files they lie in, and checksummed and written at once.
A range larger than kernel_copy's small ones (a large tensor's run) goes to kernel_copy as before.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from .. import interrupts
from . import kernel_copy
from .checksum import crc32 as _crc

if TYPE_CHECKING:
    import numpy as np

__all__ = ["RangeTable", "copy_with_crc", "read"]

# output bytes gathered at once: the gather's index array is this many elements at most (8 bytes
# each), so memory stays flat whatever the tensor's size
_WINDOW = 2 << 20
# a window's ranges in one file are read as one block when it is at most this many times the
# bytes they need (plus _SLACK): a ZeRO slice reads its parameters' slices with the other ranks'
# slices between them; farther apart, the window's ranges are read one by one (kernel_copy.read)
_SPREAD = 4
_SLACK = 1 << 20


class RangeTable:
    """Range i: `nbytes[i]` bytes at `offsets[i]` of `files[fids[i]]`, or zeros where fids[i] < 0
    (offset 0). The same ranges as kernel_copy's list of (file, offset, nbytes) (as_list)."""

    __slots__ = ("files", "fids", "offsets", "nbytes")

    def __init__(self, files: list[str], fids: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray) -> None:
        self.files, self.fids, self.offsets, self.nbytes = files, fids, offsets, nbytes

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total(self) -> int:
        return int(self.nbytes.sum())

    def as_list(self) -> kernel_copy.Ranges:
        files = self.files
        return [
            (files[f] if f >= 0 else None, o, n)
            for f, o, n in zip(self.fids.tolist(), self.offsets.tolist(), self.nbytes.tolist())
        ]


def read(source: Any, table: RangeTable) -> bytes:
    """The concatenated ranges in memory (any source that can read)."""
    if _large(table):
        return kernel_copy.read(source, table.as_list())
    return b"".join(bytes(w) for w in _gathered(source, table, _source_block))


def copy_with_crc(
    source: Any, table: RangeTable, out: BinaryIO, advance: Callable[[int], Any] = lambda n: None
) -> tuple[int, int]:
    """kernel_copy.copy_with_crc of the table's ranges: the bytes written and their CRC32
    (a local source)."""
    if _large(table):
        return kernel_copy.copy_with_crc(source, table.as_list(), out, advance)
    out.flush()
    fd = out.fileno()
    total = crc = 0
    for window in _gathered(source, table, _pread_block):
        view = memoryview(window).cast("B")
        crc = _crc(view, crc)
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        advance(len(view))
        total += len(view)
    return total, crc


def _large(table: RangeTable) -> bool:
    """Whether a range is larger than a small one: kernel_copy copies those in the kernel."""
    return bool(len(table)) and int(table.nbytes.max()) > kernel_copy.SMALL_READ


def _gathered(source: Any, table: RangeTable, read_block: Callable[[Any, str, int, int], bytes]) -> Iterator[Any]:
    """The ranges' bytes in order, a window of about _WINDOW bytes at a time (every range at
    most kernel_copy.SMALL_READ bytes)."""
    import numpy as np  # here, not at import: only a flat table's ranges need it

    nbytes, fids, offsets = table.nbytes, table.fids, table.offsets
    if not len(nbytes):
        return
    data = fids >= 0
    # the gather moves units of the largest size dividing every offset and length (4 for fp32)
    unit = math.gcd(8, int(np.gcd.reduce(np.concatenate((offsets[data], nbytes))))) or 1
    view_as = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[unit]
    ends = np.cumsum(nbytes)
    cuts = np.searchsorted(ends, np.arange(_WINDOW, int(ends[-1]), _WINDOW), side="left") + 1
    bounds = [0, *sorted(set(cuts.tolist()) - {0, len(nbytes)}), len(nbytes)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        interrupts.check()  # after a Ctrl-C, the copy stops at its next window
        window = _window(source, table, a, b, unit, view_as, read_block)
        if window is None:  # ranges too far apart to read as blocks: one by one
            window = kernel_copy.read(source, RangeTable(table.files, fids[a:b], offsets[a:b], nbytes[a:b]).as_list())
        yield window


def _window(
    source: Any,
    table: RangeTable,
    a: int,
    b: int,
    unit: int,
    view_as: Any,
    read_block: Callable[[Any, str, int, int], bytes],
) -> np.ndarray | None:
    """The bytes of ranges [a, b): each file's block holding its ranges read once, then one
    gather; None where a file's block would be much larger than what its ranges need."""
    import numpy as np

    fids, offsets, nbytes = table.fids[a:b], table.offsets[a:b], table.nbytes[a:b]
    where = np.empty(b - a, dtype=np.int64)  # each range's first byte in the blocks, end to end
    blocks: list[np.ndarray] = []
    at = 0
    for f in (np.flatnonzero(np.bincount(fids + 1)) - 1).tolist():  # (np.unique imports numpy.ma: 0.08 s)
        mine = fids == f
        n = nbytes[mine]
        if f < 0:  # zeros: one block as long as the longest of them
            size = int(n.max())
            blocks.append(np.zeros(size, dtype=np.uint8))
            where[mine] = at
        else:
            o = offsets[mine]
            lo, hi = int(o.min()), int((o + n).max())
            size = hi - lo
            if size > _SPREAD * int(n.sum()) + _SLACK:
                return None
            blocks.append(np.frombuffer(read_block(source, table.files[f], lo, size), dtype=np.uint8))
            where[mine] = at + o - lo
        at += size
    held = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
    units = nbytes // unit
    count = int(units.sum())
    first = where // unit - (np.cumsum(units) - units)  # a range's unit i is at first + its output unit
    index = np.repeat(first, units) + np.arange(count, dtype=np.int64)
    return held[: len(held) - len(held) % unit].view(view_as)[index]


def _pread_block(source: Any, rel: str, offset: int, nbytes: int) -> bytes:
    return kernel_copy.pread_block(source, rel, offset, nbytes)


def _source_block(source: Any, rel: str, offset: int, nbytes: int) -> bytes:
    return kernel_copy.source_block(source, rel, offset, nbytes)
