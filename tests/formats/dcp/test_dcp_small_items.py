"""The DCP writer's small items: a chunk that is one small flat run of its tensor is
written from its archive template straight from the tensor's byte ranges, gathered into one
write per run of items; the files are byte for byte those written item by item through
write_archive_to, and torch loads them."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ckptkit.formats.dcp import writer
from ckptkit.ops.reshard import reshard
from conftest import DATA


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize(
    "name,m,fast", [("fsdp2_w2", 3, True), ("fsdp1_sharded_w2", 1, True), ("dcp_zstd_w2", 2, False)]
)  # (compressed: no plain byte ranges)
def test_small_items_are_the_item_by_item_bytes(tmp_path, monkeypatch, name, m, fast):
    real = writer._small_item
    used = []

    def counting(*a):
        got = real(*a)
        used.append(got is not None)
        return got

    monkeypatch.setattr(writer, "_small_item", counting)
    reshard(str(DATA / name), str(tmp_path / "fast"), m)
    # the fast path ran (the first item of each dtype and shape goes item by item), or declined
    assert sum(used) > 5 if fast else not any(used)
    monkeypatch.setattr(writer, "_small_item", lambda *a: None)
    reshard(str(DATA / name), str(tmp_path / "slow"), m)
    assert _files(tmp_path / "fast") == _files(tmp_path / "slow")


def test_small_items_load_in_torch(tmp_path):
    """dcp's own reader takes the gathered items (one process, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = tmp_path / "out"
    reshard(str(DATA / "fsdp2_w2"), str(out), 3)
    md = dcp.FileSystemReader(str(out)).read_metadata()
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    source_md = dcp.FileSystemReader(str(DATA / "fsdp2_w2")).read_metadata()
    truth = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in source_md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(truth, checkpoint_id=str(DATA / "fsdp2_w2"), no_dist=True)
    assert state.keys() == truth.keys()
    for k in truth:
        assert torch.equal(state[k], truth[k]), k


def _flat_start_reference(shape, box):
    """The definition: the box is one run of the row-major flattening iff every dimension
    after its first non-unit one is whole; then the flat index of its first element."""
    import math

    if math.prod(box.sizes) == 0:
        return 0
    first = next((d for d, n in enumerate(box.sizes) if n != 1), len(box.sizes))
    if any(box.sizes[d] != shape[d] for d in range(first + 1, len(shape))):
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return sum(o * st for o, st in zip(box.offsets, strides))


def test_flat_start_on_random_boxes():
    import random

    from ckptkit.index.types import Box

    rng = random.Random(3)
    runs = 0
    for _ in range(3000):
        shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(0, 4)))
        offsets = tuple(rng.randrange(n) for n in shape)
        sizes = tuple(rng.randint(0 if rng.random() < 0.05 else 1, n - o) for n, o in zip(shape, offsets))
        box = Box(offsets, sizes)
        expected = _flat_start_reference(shape, box)
        assert writer._flat_start(shape, box) == expected, (shape, box)
        runs += expected is not None
    assert 500 < runs < 2900  # both answers are exercised
