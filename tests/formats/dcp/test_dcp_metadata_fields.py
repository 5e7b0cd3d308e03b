"""The DCP reader reads torch's own kind of metadata (torch.Size of non-negative ints in chunk
objects) without a check per field, and everything else through the checked path:
the same boxes and storage keys either way, and the checked path's sentence for what is wrong."""

from __future__ import annotations

import copy
import glob
import os

import pytest

from ckptkit.errors import FormatError
from ckptkit.formats.dcp import reader
from ckptkit.safeload import restricted_loads
from ckptkit.torch_types import Size

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fixtures", "data")
METADATA = sorted(glob.glob(os.path.join(ROOT, "**", ".metadata"), recursive=True))


def _load(path: str):
    with open(path, "rb") as f:
        return restricted_loads(f.read(), path)


def _checked(md) -> reader._Merged:
    """What the checked path alone gives (the fast path switched off)."""
    merged = reader._Merged()
    fast = reader._plain_boxes
    reader._plain_boxes = lambda meta: None
    try:
        merged.add(md, "x")
    finally:
        reader._plain_boxes = fast
    return merged


@pytest.mark.parametrize("path", METADATA[:12], ids=lambda p: os.path.relpath(p, ROOT))
def test_fast_and_checked_paths_agree_on_real_metadata(path):
    md = _load(path)
    fast = reader._Merged()
    fast.add(md, "x")
    slow = _checked(md)
    assert fast.chunks == slow.chunks and list(fast.chunks) == list(slow.chunks)
    assert list(fast.storage) == list(slow.storage)
    assert all(fast.storage[k] is slow.storage[k] for k in fast.storage)


def _first_tensor(md):
    sd = md.__dict__["state_dict_metadata"]
    key = next(k for k, v in sd.items() if type(v).__name__ == "TensorStorageMetadata" and len(v.__dict__["size"]))
    return key, sd[key]


def _damaged(change):
    md = copy.deepcopy(_load(METADATA[0]))
    key, meta = _first_tensor(md)
    change(key, meta, md)
    return md


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda k, m, md: m.__dict__["chunks"][0].__dict__.__setitem__(
                "offsets", Size([-1] * len(m.__dict__["size"]))
            ),
            "chunk offsets must be a list of non-negative integers",
        ),
        (
            lambda k, m, md: m.__dict__["chunks"][0].__dict__.__setitem__(
                "sizes", Size([1] * (len(m.__dict__["size"]) + 1))
            ),
            "has a chunk of rank",
        ),
        (lambda k, m, md: m.__dict__.__setitem__("chunks", 7), "chunks must be a list"),
        (lambda k, m, md: m.__dict__.__setitem__("size", Size([-2])), "size must be a list of non-negative integers"),
        (lambda k, m, md: m.__dict__["chunks"].__setitem__(0, "chunk"), "has no field 'offsets'"),
    ],
)
def test_what_is_not_torchs_kind_gets_the_checked_paths_sentence(change, words):
    md = _damaged(change)
    with pytest.raises(FormatError, match=words):
        reader._Merged().add(md, "x")


def test_lists_instead_of_sizes_take_the_checked_path_with_the_same_result():
    def as_lists(key, meta, md):
        for chunk in meta.__dict__["chunks"]:
            chunk.__dict__["offsets"] = list(chunk.__dict__["offsets"])

    md = _damaged(as_lists)
    key, meta = _first_tensor(md)
    assert reader._plain_boxes(meta) is None
    fast = reader._Merged()
    fast.add(md, "x")
    assert fast.chunks == _checked(md).chunks


def test_negative_storage_offset_is_refused():
    md = copy.deepcopy(_load(METADATA[0]))
    index = next(iter(md.__dict__["storage_data"]))
    index.__dict__["offset"] = Size([-3] * len(index.__dict__["offset"] or (0,)))
    with pytest.raises(FormatError, match="storage record offset"):
        reader._Merged().add(md, "x")
