"""What a fast unpickling road (safeload.dcp, safeload.torchsave) must do with any input: give what
the pickle machine gives, or decline; and decline an attack quickly, within a memory bound."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from ckptkit.errors import CkptkitError


def same_or_declined(road, machine_load, data: bytes) -> bool:
    """The fast road declines, or returns what the machine builds (which then must not refuse)."""
    fast = road(data)
    if fast is None:
        return False
    try:
        want = machine_load(data)
    except CkptkitError as exc:  # pragma: no cover - the failure this test exists for
        pytest.fail(f"the fast road accepted a pickle the machine refuses: {exc}")
    assert fast == want
    return True


def declined_quickly(road, data: bytes, max_bytes: int, seconds: float = 5.0) -> None:
    """The road declines `data` within `seconds`, allocating less than `max_bytes` (tracemalloc)."""
    tracemalloc.start()
    start = time.process_time()  # CPU time: the bound is the road's work, not the machine's load
    try:
        assert road(data) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.process_time() - start < seconds
    assert peak < max_bytes
