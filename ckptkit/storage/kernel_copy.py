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
from typing import Any, BinaryIO

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
_SMALL = 64 << 10
_PER_RANGE = 4 << 10
# the most one copy_file_range call moves: a Ctrl-C (interrupts.check) is seen between calls
_KERNEL_CHUNK = 256 << 20
# copy_file_range refuses some pairs of files (across filesystems on many kernels, some network
# and FUSE filesystems): those bytes go through a buffer instead, and the pair is remembered
_UNSUPPORTED = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF)
_no_kernel_copy: set[tuple[int, int]] = set()


def available(source: Any) -> bool:
    """Only local sources have descriptors to copy from."""
    return hasattr(os, "copy_file_range") and hasattr(source, "fileno")


def crc32(source: Any, ranges: Ranges) -> int:
    """CRC32 of the concatenated ranges: a small range read with one pread (a ZeRO partition is
    thousands of them), a large one over short-lived memory maps of the source (no copy; each
    window is unmapped before the next, so resident memory stays at one window)."""
    crc = 0
    since_check = _WINDOW  # the first range checks: a Ctrl-C already pending stops at once
    for rel, offset, nbytes in ranges:
        if type(rel) is str and nbytes <= _SMALL:
            since_check += nbytes + _PER_RANGE
            if since_check >= _WINDOW:
                interrupts.check()
                since_check = 0
            crc = _crc(_pread(source, rel, offset, nbytes), crc)
            continue
        done = 0
        while done < nbytes:
            if rel is None:
                n = min(len(_ZEROS), nbytes - done)
                crc = _crc(_ZEROS[:n], crc)
            elif isinstance(rel, bytes):
                n = nbytes - done
                crc = _crc(memoryview(rel)[offset + done:offset + nbytes], crc)
            else:
                interrupts.check()
                n = min(_WINDOW, nbytes - done)
                crc = _crc_window(source, rel, offset + done, n, crc)
            done += n
    return crc


def _pread(source: Any, rel: str, offset: int, nbytes: int) -> bytes:
    """nbytes at offset of a source file, in one positional read."""
    data = os.pread(source.fileno(rel), nbytes, offset)
    if len(data) != nbytes:
        raise OSError(f"{source.label(rel)}: ends before byte {offset + len(data)}")
    return data


def _crc_window(source: Any, rel: str, offset: int, nbytes: int, crc: int) -> int:
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    # Every view of the map is released explicitly before the map closes: an exception raised
    # inside _crc (a Ctrl-C lands at the entry of any Python function) keeps that frame, and the
    # view it was given, alive in its traceback, and closing a map with a live view raises
    # BufferError, which would replace the KeyboardInterrupt.
    with mmap.mmap(source.fileno(rel), nbytes + (offset - start), prot=mmap.PROT_READ, offset=start) as window, \
            memoryview(window) as view, view[offset - start:] as part:
        return _crc(part, crc)


def read(source: Any, ranges: Ranges) -> bytes:
    """The concatenated ranges in memory (for small values; any source that can read)."""
    parts = []
    for rel, offset, nbytes in ranges:
        if rel is None:
            parts.append(bytes(nbytes))
        elif isinstance(rel, bytes):
            parts.append(rel[offset:offset + nbytes])
        else:
            parts.append(source.read(rel, offset, nbytes))
    return b"".join(parts)


def copy(source: Any, ranges: Ranges, out: BinaryIO, advance=lambda n: None) -> int:
    """Append the ranges to `out` at its current position; returns the bytes written.

    Small ranges (a ZeRO partition is thousands of a parameter's slices) are gathered, each with
    one pread, and written together; a large one is copied in the kernel."""
    out.flush()
    out_fd = out.fileno()
    total = 0
    pending = bytearray()   # small ranges read, not yet written
    since_check = _WINDOW  # the first range checks: a Ctrl-C already pending stops at once

    def flush() -> None:
        if pending:
            _write_all(out_fd, memoryview(pending))
            advance(len(pending))
            del pending[:]

    for rel, offset, nbytes in ranges:
        since_check += nbytes + _PER_RANGE
        if since_check >= _WINDOW:
            interrupts.check()
            since_check = 0
        if nbytes <= _SMALL:
            if rel is None:
                pending += _ZEROS[:nbytes]
            elif isinstance(rel, bytes):
                pending += memoryview(rel)[offset:offset + nbytes]
            else:
                pending += _pread(source, rel, offset, nbytes)
            if len(pending) >= _BUFFER:
                flush()
        else:
            flush()
            if rel is None:
                left = nbytes
                while left:
                    left -= os.write(out_fd, _ZEROS[:min(left, len(_ZEROS))])
            elif isinstance(rel, bytes):
                _write_all(out_fd, memoryview(rel)[offset:offset + nbytes])
            else:
                _copy_range(source, rel, offset, nbytes, out_fd)
            advance(nbytes)
        total += nbytes
    flush()
    return total


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
        view = memoryview(buf)[:min(len(buf), nbytes - done)]
        got = os.preadv(src_fd, [view], offset + done)
        if got <= 0:
            raise OSError(f"{source.label(rel)}: ends before byte {offset + done}")
        _write_all(out_fd, view[:got])
        done += got


def _write_all(fd: int, data: memoryview) -> None:
    written = 0
    while written < len(data):
        written += os.write(fd, data[written:])
