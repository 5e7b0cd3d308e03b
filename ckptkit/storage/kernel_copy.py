"""Moving bytes from source files to an output file inside the kernel.

When a tensor's bytes in the output are just a sequence of source byte ranges (a ZeRO partition
slice, a dim-0 chunk, a whole tensor) there is nothing to compute: os.copy_file_range copies
them without passing through Python, as `cp` does. Checksums, where the output format needs
them, are computed over short-lived memory maps, one window at a time, so memory stays flat.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any, BinaryIO, Callable

from .. import interrupts
from .checksum import crc32 as _crc

# (source file, offset, nbytes); (None, 0, nbytes) for zeros; (bytes, offset, nbytes) for bytes held
# in memory (a small tensor convert built, such as an optimizer step)
Ranges = list[tuple[str | bytes | None, int, int]]

_ZEROS = bytes(1 << 20)
# a window is resident while its CRC is computed (file pages count in RSS): small enough that
# peak memory does not depend on tensor sizes, large enough that mapping costs nothing measurable
_WINDOW = 2 << 20
_BUFFER = 8 << 20
# a range this small is read with one pread (into memory) rather than mapped or copied in the
# kernel: a map or a copy_file_range costs more than the bytes; _PER_RANGE weighs a range's
# fixed cost against bytes, so a Ctrl-C is checked after about a window's worth of work
SMALL_READ = 64 << 10
_PER_RANGE = 4 << 10
# small ranges of one file that lie close together are read as one block of at most _BLOCK bytes:
# a gap of up to _GAP bytes between them costs less to read than another call (and, from a
# thread, another wait for the GIL); a ZeRO partition's slices are thousands of neighbours
_BLOCK = 1 << 20
_GAP = 4 << 10
# blocks kept at once (one per source file being read: a ZeRO slice alternates between ranks)
_OPEN_BLOCKS = 16
# the most one copy_file_range call moves: a Ctrl-C (interrupts.check) is seen between calls
_KERNEL_CHUNK = 256 << 20
# copy_file_range refuses some pairs of files (across filesystems on many kernels, some network
# and FUSE filesystems): those bytes go through a buffer instead, and the pair is remembered
_UNSUPPORTED = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF)
_no_kernel_copy: set[tuple[int, int]] = set()


def available(source: Any) -> bool:
    """Only local sources have descriptors to copy from."""
    return hasattr(os, "copy_file_range") and hasattr(source, "fileno")


def _crc_large(source: Any, rel: str | bytes | None, offset: int, nbytes: int, crc: int) -> int:
    """`crc` continued over one range that is not read as a small one."""
    done = 0
    while done < nbytes:
        if rel is None:
            n = min(len(_ZEROS), nbytes - done)
            crc = _crc(_ZEROS[:n], crc)
        elif isinstance(rel, bytes):
            n = nbytes - done
            crc = _crc(memoryview(rel)[offset + done : offset + nbytes], crc)
        else:
            interrupts.check()
            n = min(_WINDOW, nbytes - done)
            crc = _crc_window(source, rel, offset + done, n, crc)
        done += n
    return crc


class _SmallReads:
    """The bytes of the small file ranges of one list of ranges, read a block at a time: the
    ranges of a file that follow each other closely (up to _GAP bytes apart, in increasing
    order, _BLOCK bytes in all) share one read. The blocks are planned in one pass over the
    list, so a block is read once, when its first range comes, and holds only bytes up to its
    last range: nothing is read that a range does not need but the gaps."""

    def __init__(self, source: Any, ranges: Ranges, read_block: Callable[[Any, str, int, int], bytes]) -> None:
        self._source, self._read_block = source, read_block
        self.block_of: list[int] = []  # per range: its block's number, -1 for a range not read here
        self.blocks: list[list[Any]] = []  # [file, start, end]
        last: dict[str, int] = {}  # file -> its latest block
        for rel, offset, nbytes in ranges:
            if type(rel) is not str or nbytes > SMALL_READ:
                self.block_of.append(-1)
                continue
            b = last.get(rel)
            if b is not None:
                block = self.blocks[b]
                if block[1] <= offset <= block[2] + _GAP and offset + nbytes - block[1] <= _BLOCK:
                    if offset + nbytes > block[2]:
                        block[2] = offset + nbytes
                    self.block_of.append(b)
                    continue
            last[rel] = len(self.blocks)
            self.block_of.append(len(self.blocks))
            self.blocks.append([rel, offset, offset + nbytes])
        self._open: dict[str, tuple[int, memoryview]] = {}

    def get(self, i: int, rel: str, offset: int, nbytes: int) -> memoryview:
        """Range i's bytes (`rel`, `offset`, `nbytes` as listed)."""
        b = self.block_of[i]
        held = self._open.get(rel)
        if held is None or held[0] != b:
            _, start, end = self.blocks[b]
            if rel not in self._open and len(self._open) >= _OPEN_BLOCKS:
                del self._open[next(iter(self._open))]
            held = self._open[rel] = (b, memoryview(self._read_block(self._source, rel, start, end - start)))
        start = self.blocks[b][1]
        return held[1][offset - start : offset - start + nbytes]


def pread_block(source: Any, rel: str, offset: int, nbytes: int) -> bytes:
    """nbytes at offset of a source file, in one positional read."""
    data = os.pread(source.fileno(rel), nbytes, offset)
    if len(data) != nbytes:
        raise OSError(f"{source.label(rel)}: ends before byte {offset + len(data)}")
    return data


def source_block(source: Any, rel: str, offset: int, nbytes: int) -> bytes:
    """nbytes at offset of a source file, through the source's own reads (any storage)."""
    return source.read(rel, offset, nbytes)


def _crc_window(source: Any, rel: str, offset: int, nbytes: int, crc: int) -> int:
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    # Every view of the map is released explicitly before the map closes: an exception raised
    # inside _crc (a Ctrl-C lands at the entry of any Python function) keeps that frame, and the
    # view it was given, alive in its traceback, and closing a map with a live view raises
    # BufferError, which would replace the KeyboardInterrupt.
    with (
        mmap.mmap(source.fileno(rel), nbytes + (offset - start), prot=mmap.PROT_READ, offset=start) as window,
        memoryview(window) as view,
        view[offset - start :] as part,
    ):
        return _crc(part, crc)


def read(source: Any, ranges: Ranges) -> bytes:
    """The concatenated ranges in memory (for small values; any source that can read)."""
    parts: list[Any] = []
    small = _SmallReads(source, ranges, source_block)
    for i, (rel, offset, nbytes) in enumerate(ranges):
        if rel is None:
            parts.append(bytes(nbytes))
        elif isinstance(rel, bytes):
            parts.append(rel[offset : offset + nbytes])
        elif nbytes <= SMALL_READ:
            parts.append(small.get(i, rel, offset, nbytes))
        else:
            parts.append(source.read(rel, offset, nbytes))
    return b"".join(parts)


def copy(source: Any, ranges: Ranges, out: BinaryIO, advance: Callable[[int], Any] = lambda n: None) -> int:
    """Append the ranges to `out` at its current position; returns the bytes written.

    Small ranges (a ZeRO partition is thousands of a parameter's slices) are gathered, read a
    block of neighbours at a time, and written together; a large one is copied in the kernel."""
    return _copy(source, ranges, out, advance, False)[0]


def copy_with_crc(
    source: Any, ranges: Ranges, out: BinaryIO, advance: Callable[[int], Any] = lambda n: None
) -> tuple[int, int]:
    """copy, and the CRC32 of the bytes written (a zip record's): a small range's bytes are
    checksummed as they pass, so they are read once; a large one is checksummed over memory
    maps, then copied in the kernel."""
    return _copy(source, ranges, out, advance, True)


def _copy(source: Any, ranges: Ranges, out: BinaryIO, advance: Callable[[int], Any], with_crc: bool) -> tuple[int, int]:
    out.flush()
    out_fd = out.fileno()
    total = crc = 0
    pending = bytearray()  # small ranges read, not yet written
    since_check = _WINDOW  # the first range checks: a Ctrl-C already pending stops at once
    small = _SmallReads(source, ranges, pread_block)

    def flush() -> None:
        if pending:
            _write_all(out_fd, memoryview(pending))
            advance(len(pending))
            del pending[:]

    for i, (rel, offset, nbytes) in enumerate(ranges):
        since_check += nbytes + _PER_RANGE
        if since_check >= _WINDOW:
            interrupts.check()
            since_check = 0
        if nbytes <= SMALL_READ:
            if rel is None:
                data: Any = _ZEROS[:nbytes]
            elif isinstance(rel, bytes):
                data = memoryview(rel)[offset : offset + nbytes]
            else:
                data = small.get(i, rel, offset, nbytes)
            if with_crc:
                crc = _crc(data, crc)
            pending += data
            if len(pending) >= _BUFFER:
                flush()
        else:
            flush()
            if with_crc:
                crc = _crc_large(source, rel, offset, nbytes, crc)
            if rel is None:
                left = nbytes
                while left:
                    left -= os.write(out_fd, _ZEROS[: min(left, len(_ZEROS))])
            elif isinstance(rel, bytes):
                _write_all(out_fd, memoryview(rel)[offset : offset + nbytes])
            else:
                _copy_range(source, rel, offset, nbytes, out_fd)
            advance(nbytes)
        total += nbytes
    flush()
    return total, crc


def _copy_range(source: Any, rel: str, offset: int, nbytes: int, out_fd: int) -> None:
    src_fd, done = source.fileno(rel), 0
    pair = (os.fstat(src_fd).st_dev, os.fstat(out_fd).st_dev)
    while done < nbytes and pair not in _no_kernel_copy:
        interrupts.check()
        try:
            n = os.copy_file_range(src_fd, out_fd, min(_KERNEL_CHUNK, nbytes - done), offset + done)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise  # ENOSPC, EIO, ...: a real failure
            _no_kernel_copy.add(pair)
            break
        if n <= 0:
            raise OSError(f"copy_file_range stopped at byte {offset + done} of {source.label(rel)}")
        done += n
    buf = bytearray(min(_BUFFER, max(0, nbytes - done)))
    while done < nbytes:
        interrupts.check()
        view = memoryview(buf)[: min(len(buf), nbytes - done)]
        got = os.preadv(src_fd, [view], offset + done)
        if got <= 0:
            raise OSError(f"{source.label(rel)}: ends before byte {offset + done}")
        _write_all(out_fd, view[:got])
        done += got


def _write_all(fd: int, data: memoryview) -> None:
    written = 0
    while written < len(data):
        written += os.write(fd, data[written:])
