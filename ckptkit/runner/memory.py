"""Keep freed slab buffers from piling up in the heap.

glibc raises its mmap threshold each time a large mmapped block is freed, so after the first
slab every later multi-MB buffer comes from the heap, where fragmentation across threads makes
peak RSS creep up with the number of slabs, i.e. with checkpoint size. Pinning the threshold
(which disables the dynamic adjustment) sends every large buffer back to the OS when freed.
Only the CLI calls this: a library must not change malloc settings of a training process.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3


def pin_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Pin glibc's mmap threshold; returns False where that is not possible (non-glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
    except (OSError, AttributeError):
        return False
