"""Moving bytes from source files to an output file inside the kernel.

When a tensor's bytes in the output are just a sequence of source byte ranges (a ZeRO partition
slice, a dim-0 chunk, a whole tensor) there is nothing to compute: os.copy_file_range copies
them without passing through Python, as `cp` does. Checksums, where the output format needs
them, are computed over short-lived memory maps, one window at a time, so memory stays flat.
"""
from __future__ import annotations

import mmap
import os
from typing import Any, BinaryIO

from .checksum import crc32 as _crc

Ranges = list[tuple[str | None, int, int]]  # (source file or None for zeros, offset, nbytes)

_ZEROS = bytes(1 << 20)
_WINDOW = 64 << 20


def available(source: Any) -> bool:
    """Only local sources have descriptors to copy from."""
    return hasattr(os, "copy_file_range") and hasattr(source, "fileno")


def crc32(source: Any, ranges: Ranges) -> int:
    """CRC32 of the concatenated ranges, over short-lived memory maps of the source (no copy;
    each window is unmapped before the next, so resident memory stays at one window)."""
    crc = 0
    for rel, offset, nbytes in ranges:
        done = 0
        while done < nbytes:
            if rel is None:
                n = min(len(_ZEROS), nbytes - done)
                crc = _crc(_ZEROS[:n], crc)
            else:
                n = min(_WINDOW, nbytes - done)
                crc = _crc_window(source, rel, offset + done, n, crc)
            done += n
    return crc


def _crc_window(source: Any, rel: str, offset: int, nbytes: int, crc: int) -> int:
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(source.fileno(rel), nbytes + (offset - start), prot=mmap.PROT_READ, offset=start) as window:
        view = memoryview(window)
        try:
            return _crc(view[offset - start:], crc)
        finally:
            view.release()


def copy(source: Any, ranges: Ranges, out: BinaryIO, advance=lambda n: None) -> int:
    """Append the ranges to `out` at its current position; returns the bytes written."""
    out.flush()
    out_fd = out.fileno()
    total = 0
    for rel, offset, nbytes in ranges:
        if rel is None:
            left = nbytes
            while left:
                left -= os.write(out_fd, _ZEROS[:min(left, len(_ZEROS))])
        else:
            src_fd, done = source.fileno(rel), 0
            while done < nbytes:
                n = os.copy_file_range(src_fd, out_fd, nbytes - done, offset + done)
                if n <= 0:
                    raise OSError(f"copy_file_range stopped at byte {offset + done} of {source.label(rel)}")
                done += n
        advance(nbytes)
        total += nbytes
    return total
