"""DCP `.metadata` written as opcodes (formats/dcp/metadata_pickle) equals, byte for byte, the
stand-ins pickled by repickle (FaithfulPickler and its fast path), which equal torch's own
pickling of its Metadata classes (test_torch_free); it declines where it does not know the bytes."""

from __future__ import annotations

import io
import pickle

import pytest

from ckptkit.formats.dcp.metadata_pickle import metadata_pickle
from ckptkit.formats.dcp.writer import DCP_VERSION, _Written, build_metadata, metadata_stand_ins
from ckptkit.index.types import Box, CheckpointIndex, ObjectEntry, TensorEntry
from ckptkit.repickle import FaithfulPickler, dumps
from helpers.dcp_metadata_inputs import SAVE_ID, many_written


def _faithful(obj) -> bytes:
    buf = io.BytesIO()
    FaithfulPickler(buf, 2).dump(obj)
    return buf.getvalue()


def _check(index, written, key_order=None, faithful: bool = True) -> bytes:
    ours = metadata_pickle(index, written, key_order, SAVE_ID, DCP_VERSION)
    assert ours is not None
    stand_ins = metadata_stand_ins(index, written, key_order, SAVE_ID)
    assert ours == dumps(stand_ins, protocol=2)
    if faithful:
        assert ours == _faithful(stand_ins)
    pickle.loads(ours)  # (torch's classes, where torch is installed)
    return ours


@pytest.mark.parametrize("n,chunks", [(1, 1), (2, 2), (300, 1), (1001, 1), (999, 2), (1500, 2)])
def test_many_tensors_byte_for_byte(n, chunks):
    """Memo indexes past 255 (LONG_BINPUT), dicts and lists across pickle's batches of 1000
    (and a last batch of one item: SETITEM without MARK)."""
    index, written = many_written(n, chunks)
    _check(index, written, faithful=n <= 300)


def test_one_tensor_of_1001_chunks():
    index, written = many_written(1, 1001, shape=(1001, 2))
    _check(index, written)


@pytest.mark.parametrize("n", [3, 120])  # (120: most chunks past memo index 255, the one-join path)
@pytest.mark.parametrize("shape", [(), (0,), (6,), (2, 3, 4, 5), (4, 2, 2, 2, 2), (600, 70000)])
def test_shapes(shape, n):
    """0-dim (the empty tuple, never memoized), empty, more than 3 dims (MARK ... TUPLE), sizes
    past one and two bytes."""
    index, written = many_written(n, 1 if not shape or shape[0] < 2 else 2, shape=shape)
    _check(index, written)


def test_offsets_past_32_bits_after_memo_255():
    index, written = many_written(200, 2)
    written = [_Written(w.key, w.box, w.file, w.offset << 33, w.length << 31) for w in written]
    _check(index, written)


def test_values_transforms_key_order_and_large_ints():
    index = CheckpointIndex(format="dcp", root="x")
    index.add_tensor(TensorEntry("model.w", "bfloat16", (4, 3), [], path=("model", "w")))
    index.add_tensor(TensorEntry("optim.state.w.step", "float32", (), [], path=("optim", "state", "w", "step")))
    index.add_tensor(TensorEntry("nopath", "int64", (3,), []))
    index.add_object(ObjectEntry("optim.param_groups.0.lr", 0.1, path=("optim", "param_groups", 0, "lr")))
    index.add_object(ObjectEntry("extra", {"a": 1}))
    written = [
        _Written("model.w", Box((0, 0), (2, 3)), "__0_0.distcp", 0, 100),
        _Written("optim.param_groups.0.lr", None, "__0_0.distcp", 150, 30, ("zstd", "x")),
        _Written("model.w", Box((2, 0), (2, 3)), "__1_0.distcp", 1 << 40, 70000),
        _Written("optim.state.w.step", Box((), ()), "__0_0.distcp", 100, 50),
        _Written("nopath", Box((0,), (3,)), "__0_0.distcp", 3 << 31, 1 << 31),
        _Written("extra", None, "__0_0.distcp", 250, 30),
    ]
    _check(index, written)
    _check(index, written, key_order=["extra", "nopath", "optim.param_groups.0.lr", "model.w"])


def test_shared_strings_follow_identity():
    """pickle's memo follows identity: a key that is the very object of a field name (an interned
    'offset') is referred back to; an equal but distinct string is written again."""
    index = CheckpointIndex(format="dcp", root="x")
    index.add_tensor(TensorEntry("offset", "float32", (2,), []))
    index.add_tensor(TensorEntry("".join(["si", "ze"]), "float32", (2,), []))
    written = [
        _Written("offset", Box((0,), (2,)), "__0_0.distcp", 0, 10),
        _Written("size", Box((0,), (2,)), "".join(["__0_0", ".distcp"]), 10, 10),
    ]
    _check(index, written)


def test_declines_what_it_does_not_know():
    """A value written twice (its stand-in keys would merge) or a path holding something other
    than strs and ints: None, and build_metadata pickles the stand-ins (same bytes as before)."""
    index = CheckpointIndex(format="dcp", root="x")
    index.add_object(ObjectEntry("v", 1))
    twice = [_Written("v", None, "__0_0.distcp", 0, 10), _Written("v", None, "__1_0.distcp", 0, 10)]
    assert metadata_pickle(index, twice, None, SAVE_ID, DCP_VERSION) is None
    assert pickle.loads(build_metadata(index, twice)) is not None
    odd = CheckpointIndex(format="dcp", root="x")
    odd.add_tensor(TensorEntry("w", "float32", (2,), [], path=("w", 1.5)))
    written = [_Written("w", Box((0,), (2,)), "__0_0.distcp", 0, 10)]
    assert metadata_pickle(odd, written, None, SAVE_ID, DCP_VERSION) is None
    assert build_metadata(odd, written) == dumps(metadata_stand_ins(odd, written, None, _save_id(written)), protocol=2)


def _save_id(written) -> str:
    import uuid

    return uuid.uuid5(
        uuid.NAMESPACE_URL, "ckptkit-dcp:" + repr([(w.key, w.box, w.file, w.offset, w.length) for w in written])
    ).hex
