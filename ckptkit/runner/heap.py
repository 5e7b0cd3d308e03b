"""The collector kept off the index while a command writes.

A command holds its index (at 30k DCP tensors, millions of objects) for the whole write, and the
write allocates many small objects (a record per item, a few tuples per chunk), which trigger
full collections; each traverses the whole index again and finds nothing to free (three of
~0.7 s each at 30k tensors). `frozen_heap` moves everything alive when the write starts out of
the collector's sight (gc.freeze) and gives it back afterwards: collections still run, over what
the write allocates.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap"]


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Objects alive now are not traversed by the collector inside the block. Does nothing
    where the caller froze objects itself (its freeze is left as it is) or paused the collector."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
