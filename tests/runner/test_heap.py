"""runner.heap.frozen_heap: what is alive when a write starts is out of the collector's sight
inside the block and given back after it, also on an error; a caller's own freeze is kept."""

from __future__ import annotations

import gc
import weakref

import pytest

from ckptkit.runner.heap import frozen_heap


def test_freezes_inside_and_gives_back():
    assert gc.get_freeze_count() == 0
    held = [[i] for i in range(1000)]
    with frozen_heap():
        assert gc.get_freeze_count() >= len(held)
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with frozen_heap():
            raise RuntimeError("write failed")
    assert gc.get_freeze_count() == 0


class _Node:
    pass


def test_a_cycle_freed_inside_is_collected_after():
    """An object frozen with the heap that becomes garbage inside is collected once given back."""
    node = _Node()
    node.me = node
    ref = weakref.ref(node)
    with frozen_heap():
        del node
        gc.collect()
        assert ref() is not None  # frozen: out of the collector's sight
    gc.collect()
    assert ref() is None


def test_leaves_a_callers_freeze_and_a_paused_collector_alone():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with frozen_heap():
            pass
        # not unfrozen under the caller (an unfreeze empties the permanent generation; frozen
        # objects that die meanwhile leave it one by one, so the count is not exact in a full run)
        assert gc.get_freeze_count() > before // 2 > 0
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with frozen_heap():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_paused_collector_pauses_inside_and_gives_it_back_even_on_error():
    from ckptkit.runner.heap import paused_collector

    assert gc.isenabled()
    with paused_collector():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with paused_collector():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_collector():
            pass
        assert not gc.isenabled()  # the caller's pause is left as it was
    finally:
        gc.enable()


def test_indexes_are_read_with_the_collector_paused(monkeypatch):
    """open_checkpoint reads every format's index with the collector paused, and resumes it."""
    import os

    from ckptkit.formats import dcp as _  # noqa: F401
    from ckptkit.formats import registry
    from ckptkit.formats.dcp import reader

    seen = []
    real = reader.read_index
    monkeypatch.setattr(reader, "read_index", lambda source, *a, **k: (seen.append(gc.isenabled()), real(source))[1])
    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "data", "fsdp2_w3")
    registry.open_checkpoint(fixture)
    assert seen == [False] and gc.isenabled()


def test_paused_collector_hands_what_it_made_to_the_oldest_generation():
    """What the paused block allocated skips the young generations (no traversal of all of it by
    the first collection after), is not left frozen, and its cycles are still collected."""
    from ckptkit.runner.heap import paused_collector

    gc.collect()
    with paused_collector():
        held = [[i] for i in range(20000)]
        node = _Node()
        node.me = node
        ref = weakref.ref(node)
        del node
        assert gc.get_count()[0] > len(held)  # counted while paused
    assert gc.get_count()[0] < 100 and gc.get_freeze_count() == 0
    assert gc.is_tracked(held[-1])
    gc.collect()
    assert ref() is None


def test_paused_collector_leaves_a_callers_freeze_alone():
    from ckptkit.runner.heap import paused_collector

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with paused_collector():
            held = [[i] for i in range(1000)]
        assert gc.get_freeze_count() >= frozen // 2 > 0 and len(held) == 1000
    finally:
        gc.unfreeze()
