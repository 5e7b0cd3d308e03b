"""The DCP reader's item templates (a DCP checkpoint of 100k small tensors is 100k
torch.save archives to check while indexing).

After an item of a kind (archive length, dtype, shape) passed the full path, a template serves the
next items of that kind whose zip layout and data.pkl are byte-equal, with their own offsets and
CRC32s. These tests hold it to what it promises: for a genuine dcp.save folder, for every
single-byte change of a templated item and for damaged storage records, the reader gives exactly
what the full path gives with no memo at all (the same pieces, locations and integrity checks, or
the same refusal)."""

from __future__ import annotations

import types

import pytest
import torch

from ckptkit.errors import CkptkitError
from ckptkit.formats.dcp import reader
from ckptkit.formats.dcp.item_templates import ItemTemplates
from ckptkit.index.types import Box, IntegrityCheck, Location, Piece, TensorEntry
from ckptkit.storage.source import LocalSource
from conftest import dataclass_fields as _fields, save_random_dcp
from helpers.zip_rewrites import repacked

DATA_FILE = "__0_0.distcp"


class _Patched(LocalSource):
    """A local folder whose data file reads with one byte flipped (`flip`: position, mask)."""

    flip: tuple[int, int] | None = None

    def read(self, rel: str, offset: int, length: int) -> bytes:
        data = super().read(rel, offset, length)
        if self.flip is not None and rel == DATA_FILE and offset <= self.flip[0] < offset + len(data):
            changed = bytearray(data)
            changed[self.flip[0] - offset] ^= self.flip[1]
            data = bytes(changed)
        return data


def _folder(tmp_path, count: int, repack: bool = False) -> tuple[_Patched, list]:
    """A genuine dcp.save folder of `count` float32 [4, 8] tensors and its item jobs; `repack`: its
    items rewritten by zipfile, back to back in a data file of their own."""
    save_random_dcp(tmp_path / "saved", count, (4, 8), seed=5)
    source = LocalSource(str(tmp_path / "saved"))
    merged = reader._Merged()
    merged.add(reader._load_metadata(source, ".metadata"), "x")
    index = reader._new_index(source, [".metadata"], merged)
    jobs = reader._item_jobs(index, merged, "x")
    if not repack:
        return _Patched(str(tmp_path / "saved")), jobs
    items = [repacked(source.read(info.relative_path, info.offset, info.length)) for _, _, info in jobs]
    (tmp_path / "repacked").mkdir()
    (tmp_path / "repacked" / DATA_FILE).write_bytes(b"".join(items))
    starts = [sum(len(i) for i in items[:k]) for k in range(len(items))]
    jobs = [
        (target, box, types.SimpleNamespace(relative_path=DATA_FILE, offset=at, length=len(item)))
        for (target, box, _), at, item in zip(jobs, starts, items)
    ]
    return _Patched(str(tmp_path / "repacked")), jobs


def _read(source, jobs, monkeypatch, fast: bool) -> list:
    """What _read_items gives: with templates and memo, or by the full path with no memo at all.
    A refusal is its class and sentence; every piece, location and check is of its own class."""
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(reader, "StructureMemo", lambda: None)
            m.setattr(ItemTemplates, "item", lambda self, *a: None)
        results = reader._read_items(source, jobs, 1)
    out = []
    for got in results:
        if isinstance(got, CkptkitError):
            out.append((type(got).__name__, str(got)))
            continue
        piece, checks = got
        assert type(piece) is Piece and type(piece.location) is Location
        assert all(type(c) is IntegrityCheck for c in checks)
        out.append(got)
    return out


def _served(monkeypatch) -> list:
    """Counts the items a template served."""
    served = []
    real = ItemTemplates.item

    def counting(self, *a):
        got = real(self, *a)
        served.append(got is not None)
        return got

    monkeypatch.setattr(ItemTemplates, "item", counting)
    return served


@pytest.mark.parametrize("repack", [False, True], ids=["torch.save (data descriptors)", "zipfile (local CRCs)"])
def test_a_run_of_items_is_served_by_its_template_as_the_full_path_reads_it(tmp_path, monkeypatch, repack):
    source, jobs = _folder(tmp_path, 12, repack)
    full = _read(source, jobs, monkeypatch, fast=False)
    served = _served(monkeypatch)
    fast = _read(source, jobs, monkeypatch, fast=True)
    assert fast == full
    for (piece, _), (theirs, _) in zip(fast, full):  # (made without their __init__: every field, in order)
        assert _fields(piece.location) == _fields(theirs.location)
        assert _fields(piece) == _fields(theirs)
    assert sum(served) == len(jobs) - 2  # the first two of the kind go the full way (the second teaches)
    assert len({c.crc32 for _, checks in fast for c in checks}) > 20  # (each item's own CRCs)


def test_mixed_kinds_read_the_same_with_and_without_templates(tmp_path, monkeypatch):
    """Same-length items of other shapes and dtypes, values among tensors: read_index is equal."""
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(2)
    state = {}
    for i in range(6):
        state[f"a{i}"] = torch.randn(4, 8, generator=gen)
        state[f"b{i}"] = torch.randn(8, 4, generator=gen)  # same bytes, same archive length, other shape
        state[f"c{i}"] = torch.randint(0, 9, (32,), generator=gen, dtype=torch.int32)  # other dtype
        state[f"d{i}"] = torch.randn(3, generator=gen).to(torch.bfloat16)
        state[f"e{i}"] = torch.randn(4, 8, generator=gen)[:, :6]  # a strided view
        state[f"step{i}"] = i
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    served = _served(monkeypatch)
    fast = reader.read_index(LocalSource(str(tmp_path)), parallel=1)
    assert sum(served) >= 5 * 3
    monkeypatch.setattr(reader, "StructureMemo", lambda: None)
    monkeypatch.setattr(ItemTemplates, "item", lambda self, *a: None)
    full = reader.read_index(LocalSource(str(tmp_path)), parallel=1)
    assert fast.checks == full.checks and len(full.checks) > 100
    assert {k: (t.dtype, t.shape, t.pieces) for k, t in fast.tensors.items()} == {
        k: (t.dtype, t.shape, t.pieces) for k, t in full.tensors.items()
    }
    assert fast.objects.keys() == full.objects.keys()


@pytest.mark.parametrize("repack", [False, True], ids=["torch.save (data descriptors)", "zipfile (local CRCs)"])
def test_every_single_byte_change_of_a_templated_item_gets_the_full_paths_answer(tmp_path, monkeypatch, repack):
    source, jobs = _folder(tmp_path, 3, repack)
    served = _served(monkeypatch)
    unchanged = _read(source, jobs, monkeypatch, fast=True)
    assert served == [False, False, True]  # the third item meets a template
    info = jobs[2][2]
    differing = 0
    for at in range(info.offset, info.offset + info.length):
        for mask in (0x01, 0x80):
            source.flip = (at, mask)
            full = _read(source, jobs, monkeypatch, fast=False)
            assert _read(source, jobs, monkeypatch, fast=True) == full, f"byte {at - info.offset} ^ {mask:#x}"
            differing += full != unchanged
    assert differing > info.length // 4  # (the changes matter to the full path: refusals, other CRCs)


CHANGES = {
    "negative offset": {"offset": -1},
    "bool offset": {"offset": True},
    "offset past the end": {"offset": 10**9},
    "short length": {"length": 3},
    "float length": {"length": "float"},
    "a transform": {"transform_descriptors": ["zstd"]},
    "transforms not a list": {"transform_descriptors": "zstd"},
    "path outside": {"relative_path": "../x"},
    "bytes path": {"relative_path": b"__0_0.distcp"},
    "missing file": {"relative_path": "__1_0.distcp"},
    "the folder": {"relative_path": "."},
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_damaged_storage_record_gets_the_full_paths_answer(tmp_path, monkeypatch, change):
    source, jobs = _folder(tmp_path, 4)
    target, box, info = jobs[3]
    fields = dict(vars(info))
    fields.update({k: (float(fields[k]) if v == "float" else v) for k, v in CHANGES[change].items()})
    jobs[3] = (target, box, types.SimpleNamespace(**fields))
    served = _served(monkeypatch)
    fast = _read(source, jobs, monkeypatch, fast=True)
    assert served == [False, False, True, False]  # a template was there to be used
    assert fast == _read(source, jobs, monkeypatch, fast=False)
    assert isinstance(fast[3], tuple) and isinstance(fast[3][0], str)  # refused


def test_metadata_of_another_dtype_or_shape_gets_the_full_paths_sentence(tmp_path, monkeypatch):
    source, jobs = _folder(tmp_path, 4)
    for k, entry in ((2, TensorEntry("w2", "bfloat16", (4, 8))), (3, TensorEntry("w3", "float32", (8, 4)))):
        jobs[k] = (entry, Box((0, 0), entry.shape), jobs[k][2])
    fast = _read(source, jobs, monkeypatch, fast=True)
    assert fast == _read(source, jobs, monkeypatch, fast=False)
    assert "holds float32 [4, 8], metadata says bfloat16 [4, 8]" in fast[2][1]
    assert "metadata says float32 [8, 4]" in fast[3][1]
