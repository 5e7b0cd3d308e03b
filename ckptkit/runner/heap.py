"""The collector kept off the index while a command reads and writes it.

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

__all__ = ["frozen_heap", "paused_collector"]


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


@contextmanager
def paused_collector() -> Iterator[None]:
    """No collections inside the block: reading an index creates its objects (at 100k DCP tensors,
    millions), none of them garbage in a cycle, and each full collection would traverse all of
    them again and free nothing. Cycles made inside (an exception's traceback) wait for the next
    full collection after it. Does nothing where the caller paused the collector itself.

    On the way out, what the block allocated goes straight to the oldest generation (a freeze
    and unfreeze: two list splices), not through the young ones: the collector still counted
    every allocation while paused, and the first one after would otherwise traverse all of them
    (~0.2 s CPU for a ZeRO-3 index of 20k params) to free nothing. Not where the caller froze
    objects itself (an unfreeze would give its frozen objects back)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()
            gc.unfreeze()
        gc.enable()
