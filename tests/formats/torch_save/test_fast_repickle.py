"""repickle._fast_dumps writes FaithfulPickler's bytes exactly (DCP's `.metadata` of
100k tensors is a million objects, too many for pickle._Pickler's per-object machinery).

Every value _fast_dumps accepts must pickle to the same bytes as FaithfulPickler (which is
itself pinned against torch's own pickling elsewhere); anything else must be left to it."""

from __future__ import annotations

import collections
import glob
import io
import pathlib
import random

import pytest

from ckptkit import repickle
from ckptkit.safeload import Inert, restricted_loads
from ckptkit.torch_types import DType, GlobalRef, Size

FIXTURES = pathlib.Path(__file__).resolve().parents[3] / "fixtures" / "data"


def slow(obj) -> bytes:
    buf = io.BytesIO()
    repickle.FaithfulPickler(buf, 2).dump(obj)
    return buf.getvalue()


def _plain_paths(obj, seen=None):
    """The fixtures' metadata with its one non-plain value (storage_meta's PurePosixPath
    checkpoint_id) set to None, as ckptkit's own DCP writer leaves it."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Inert):
        for k, v in list(obj.__dict__.items()):
            if isinstance(v, pathlib.PurePath):
                obj.__dict__[k] = None
            else:
                _plain_paths(v, seen)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _plain_paths(k, seen)
            _plain_paths(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _plain_paths(v, seen)


METADATA = sorted(
    glob.glob(str(FIXTURES / "**" / "*.metadata"), recursive=True)
    + glob.glob(str(FIXTURES / "**" / ".metadata"), recursive=True)
)


@pytest.mark.parametrize("path", METADATA, ids=lambda p: str(pathlib.Path(p).relative_to(FIXTURES)))
def test_every_fixture_metadata_pickles_the_same(path):
    obj = restricted_loads(pathlib.Path(path).read_bytes(), path)
    _plain_paths(obj)
    fast = repickle._fast_dumps(obj)
    assert fast is not None
    assert fast == slow(obj)


def _value(rnd: random.Random, depth: int = 0):
    kind = rnd.randrange(12 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.choice([True, False])
    if kind == 2:
        return rnd.choice(
            [0, 1, 255, 256, 65535, 65536, -1, -(2**31), 2**31 - 1, 2**31, -(2**31) - 1, 2**70, -(2**70), 2**3000]
        )
    if kind == 3:
        return rnd.random() * 1e10
    if kind == 4:
        return rnd.choice(["", "a", "é\ud800x", "x" * 300, "key"])
    if kind == 5:
        return DType(rnd.choice(["float32", "bfloat16", "float"]))
    if kind == 6:
        return tuple(_value(rnd, depth + 1) for _ in range(rnd.randrange(6)))
    if kind == 7:
        n = rnd.choice([0, 1, 2, 5, 999, 1000, 1001, 2000]) if depth < 1 else rnd.randrange(3)
        return [_value(rnd, depth + 1) for _ in range(n)]
    if kind == 8:
        n = rnd.choice([0, 1, 3, 1000, 1001]) if depth < 1 else rnd.randrange(3)
        return {f"k{i}": _value(rnd, depth + 1) for i in range(n)}
    if kind == 9:
        return Size(tuple(rnd.randrange(5) for _ in range(rnd.randrange(4))))
    if kind == 10:
        return repickle.stand_in("torch.distributed.checkpoint.metadata.X", a=_value(rnd, depth + 1))
    return repickle.stand_in_call("enum.E", _value(rnd, depth + 1))


@pytest.mark.parametrize("seed", range(8))
def test_generated_values_pickle_the_same(seed):
    rnd = random.Random(seed)
    for _ in range(4):
        shared = [_value(rnd) for _ in range(3)]  # shared objects: memo references, as in real metadata
        obj = [
            _value(rnd),
            shared,
            shared[0],
            (shared[1], shared),
            {"s": shared},
            GlobalRef("torch", "Size"),
            (),
            repickle.stand_in("a.B", _state=(DType("float32"), shared)),
        ]
        rnd.shuffle(obj)
        fast = repickle._fast_dumps(obj)
        assert fast is not None
        assert fast == slow(obj)


def test_recursive_containers_pickle_the_same():
    lst: list = []
    lst.append(lst)
    tup = (lst,)
    lst.append(tup)  # a tuple that becomes recursive while its element is saved: POP then a memo GET
    big = tuple(range(5)) + (lst,)
    lst.append(big)
    assert repickle._fast_dumps(lst) == slow(lst)


def _with_attributes() -> collections.OrderedDict:
    value = collections.OrderedDict(a=1)
    value._metadata = {"": {"version": 1}}  # torch's state_dict(): pickle adds a BUILD of them
    return value


def test_ordered_dicts_pickle_the_same():
    inner = collections.OrderedDict()
    value = [collections.OrderedDict((f"k{i}", (i, inner)) for i in range(2500)), inner, collections.OrderedDict(a=1)]
    fast = repickle._fast_dumps(value)
    assert fast is not None and fast == slow(value)


@pytest.mark.parametrize("value", [_with_attributes(), [b"bytes"], {1, 2}, [pathlib.PurePosixPath("x")]])
def test_other_values_are_left_to_faithful_pickler(value):
    assert repickle._fast_dumps(value) is None
    assert repickle.dumps(value) == slow(value)  # dumps falls back whole
