"""The unchecked constructors of index/types.py (used by the DCP and ZeRO readers, one piece per
tensor and rank): what they make must be the very value the dataclasses' constructors make."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from ckptkit.index.types import (
    Box,
    Encoding,
    FlatRange,
    Location,
    Piece,
    unchecked_box,
    unchecked_flat_range,
    unchecked_location,
    unchecked_piece,
)

LOCATIONS = [
    ("a/b.pt", 0, 0),
    ("__0_0.distcp", 1 << 40, 128, Encoding.RAW, (8, 1)),
    ("x", 5, 7, Encoding.TORCH_SAVE, None, ("zstd",)),
    ("y", 3, 9, "bytes"),
]


def _fields(value: object) -> list:
    return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]


def _same(fast: object, made: object) -> None:
    assert type(fast) is type(made)
    assert fast == made and made == fast and hash(fast) == hash(made) and repr(fast) == repr(made)
    assert _fields(fast) == _fields(made)  # every field set, in the dataclass's order
    assert not hasattr(fast, "__dict__")  # slots only: a piece of a 100k-tensor index costs its fields
    assert dataclasses.astuple(fast) == dataclasses.astuple(made)
    assert pickle.loads(pickle.dumps(fast)) == made


@pytest.mark.parametrize("args", LOCATIONS, ids=str)
def test_unchecked_location_is_the_location_its_constructor_makes(args):
    _same(unchecked_location(*args), Location(*args))


@pytest.mark.parametrize("region", [FlatRange(3, 4), Box((0, 2), (4, 2)), Box((), ())], ids=repr)
def test_unchecked_piece_box_and_flat_range_are_what_their_constructors_make(region):
    loc = Location("f", 16, 64)
    fast_region = (
        unchecked_flat_range(region.start, region.length)
        if type(region) is FlatRange
        else unchecked_box(region.offsets, region.sizes)
    )
    _same(fast_region, region)
    fast = unchecked_piece(fast_region, unchecked_location("f", 16, 64))
    _same(fast, Piece(region, loc))
    assert fast.numel == region.numel
    assert {fast: 1}[Piece(region, loc)] == 1  # (usable as the same dict key)


def test_unchecked_values_stay_frozen():
    for value, name in (
        (unchecked_location("f", 0, 1), "offset"),
        (unchecked_flat_range(0, 1), "start"),
        (unchecked_box((0,), (1,)), "sizes"),
        (unchecked_piece(FlatRange(0, 1), Location("f", 0, 4)), "region"),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, 2)


def test_check_table_gives_back_the_checks_put_in():
    """CheckTable (an index's checks as columns) iterates, indexes, compares and pickles
    as the list of IntegrityChecks it stands for; a list given to the index is made one."""
    from ckptkit.index.types import CheckpointIndex, CheckTable, IntegrityCheck

    rows = [
        IntegrityCheck("a/b.distcp", 1 << 40, 7, 0xFFFFFFFF, "zip member x/data.pkl"),
        IntegrityCheck("c", 0, 0, 0, "zip member x/data/0"),
        IntegrityCheck("a/b.distcp", 9, 3, 5, "w"),
    ]
    table = CheckTable(rows[:1])
    table.extend(iter(rows[1:]))
    assert list(table) == rows and table == rows and rows == table and len(table) == 3
    assert [type(c) for c in table] == [IntegrityCheck] * 3 and table[-1] == rows[-1] and table[1:] == rows[1:]
    assert pickle.loads(pickle.dumps(table)) == rows
    table.add_members("c", 100, (4, 8), (1, 2), (11, 12), ("m0", "m1"))
    assert list(table)[3:] == [IntegrityCheck("c", 104, 1, 11, "m0"), IntegrityCheck("c", 108, 2, 12, "m1")]
    again = CheckTable()
    again.extend(table)
    assert again == table
    with pytest.raises(OverflowError):  # a CRC past 32 bits: refused, the table as it was
        again.extend([IntegrityCheck("d", 1, 1, 1, "ok"), IntegrityCheck("d", 1, 1, 1 << 32, "bad")])
    assert again == table
    index = CheckpointIndex("dcp", "/r", checks=rows)
    assert type(index.checks) is CheckTable and index.checks == rows
    index.checks = rows[:1]
    assert type(index.checks) is CheckTable and index.checks == rows[:1]
