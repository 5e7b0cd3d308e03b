"""The unchecked constructors of index/types.py (used by the DCP and ZeRO readers, one piece per
tensor and rank): what they make must be the very value the dataclasses' constructors make."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from ckptkit.index.types import (Box, Encoding, FlatRange, Location, Piece, unchecked_box, unchecked_flat_range,
                                 unchecked_location, unchecked_piece)

LOCATIONS = [
    ("a/b.pt", 0, 0),
    ("__0_0.distcp", 1 << 40, 128, Encoding.RAW, (8, 1)),
    ("x", 5, 7, Encoding.TORCH_SAVE, None, ("zstd",)),
    ("y", 3, 9, "bytes"),
]


def _same(fast: object, made: object) -> None:
    assert type(fast) is type(made)
    assert fast == made and made == fast and hash(fast) == hash(made) and repr(fast) == repr(made)
    assert list(vars(fast).items()) == list(vars(made).items())  # every field, in the dataclass's order
    assert dataclasses.astuple(fast) == dataclasses.astuple(made)
    assert pickle.loads(pickle.dumps(fast)) == made


@pytest.mark.parametrize("args", LOCATIONS, ids=str)
def test_unchecked_location_is_the_location_its_constructor_makes(args):
    _same(unchecked_location(*args), Location(*args))


@pytest.mark.parametrize("region", [FlatRange(3, 4), Box((0, 2), (4, 2)), Box((), ())], ids=repr)
def test_unchecked_piece_box_and_flat_range_are_what_their_constructors_make(region):
    loc = Location("f", 16, 64)
    fast_region = unchecked_flat_range(region.start, region.length) if type(region) is FlatRange else \
        unchecked_box(region.offsets, region.sizes)
    _same(fast_region, region)
    fast = unchecked_piece(fast_region, unchecked_location("f", 16, 64))
    _same(fast, Piece(region, loc))
    assert fast.numel == region.numel
    assert {fast: 1}[Piece(region, loc)] == 1  # (usable as the same dict key)


def test_unchecked_values_stay_frozen():
    for value, name in ((unchecked_location("f", 0, 1), "offset"), (unchecked_flat_range(0, 1), "start"), (unchecked_box((0,), (1,)), "sizes"),
                        (unchecked_piece(FlatRange(0, 1), Location("f", 0, 4)), "region")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, 2)
