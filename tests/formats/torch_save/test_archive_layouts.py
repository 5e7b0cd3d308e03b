"""The layout memo of small torch.save archives and the DCP item reading around it (a
DCP checkpoint of 30k small tensors is 30k archives to check while indexing).

StructureMemo remembers the layout of an archive that passed open_archive's checks; a later
archive of the same length whose bytes outside member data and CRC fields are equal reuses its
members (with its own offset and CRCs). These tests hold the memo to what it promises: for every
single-byte change of a remembered archive, open_archive with the memo gives exactly what it
gives without one (the same refusal, or the same members)."""

from __future__ import annotations


import pytest

from ckptkit.errors import CkptkitError, FormatError
from ckptkit.formats.dcp import reader
from ckptkit.formats.dcp.item_templates import ReadWindow
from ckptkit.runner import torch_archive as ta
from ckptkit.storage.source import BytesSource, LocalSource
from conftest import save_random_dcp
from helpers.zip_rewrites import repacked


def _dcp_items(tmp_path, count: int = 6) -> tuple[LocalSource, list]:
    save_random_dcp(tmp_path, count, (4, 8), seed=3)
    source = LocalSource(str(tmp_path))
    merged = reader._Merged()
    merged.add(reader._load_metadata(source, ".metadata"), "x")
    index = reader._new_index(source, [".metadata"], merged)
    return source, reader._item_jobs(index, merged, "x")


def _opened(data: bytes, memo: ta.StructureMemo | None, offset: int = 0):
    """What open_archive makes of `data` (at `offset` of a file): its members and prefix, or its refusal."""
    source = BytesSource(b"\0" * offset + data, "item")
    try:
        archive = ta.open_archive(source, "", offset, len(data), memo=memo, data=data)
    except CkptkitError as exc:
        return type(exc).__name__, str(exc)
    return archive.prefix, archive.members, archive.checks()


def test_dcp_items_reuse_the_first_ones_layout_with_their_own_crcs(tmp_path):
    source, jobs = _dcp_items(tmp_path)
    memo = ta.StructureMemo()
    hits = 0
    for _, _, info in jobs:
        data = source.read(info.relative_path, info.offset, info.length)
        hits += memo.layout_of(data, info.offset) is not None
        fast = ta.open_archive(source, info.relative_path, info.offset, info.length, memo=memo)
        full = ta.open_archive(source, info.relative_path, info.offset, info.length)
        assert (fast.prefix, fast.members, fast.checks()) == (full.prefix, full.members, full.checks())
    assert hits == len(jobs) - 1  # every item after the first was served by the layout
    crcs = {m.crc32 for m in full.members.values()}
    assert len(crcs) > 1  # (the members differ in CRC: the memo did not copy the first item's)


def test_read_index_is_the_same_with_and_without_the_layout_memo(tmp_path, monkeypatch):
    save_random_dcp(tmp_path, 40, (3, 5), seed=1)
    fast = reader.read_index(LocalSource(str(tmp_path)), parallel=8)  # small local items: one thread
    with monkeypatch.context() as m:
        m.setattr(reader, "LocalSource", type("Remote", (), {}))  # as a remote source is: in threads
        threaded = reader.read_index(LocalSource(str(tmp_path)), parallel=8)
    monkeypatch.setattr(reader, "StructureMemo", lambda: None)  # no memo at all: every check run per item
    monkeypatch.setattr(ReadWindow, "read", lambda self, rel, offset, length, size: None)  # one read per item
    full = reader.read_index(LocalSource(str(tmp_path)), parallel=1)
    for index in (fast, threaded):
        assert index.checks == full.checks
        assert {k: t.pieces for k, t in index.tensors.items()} == {k: t.pieces for k, t in full.tensors.items()}


@pytest.mark.parametrize("kind", ["torch.save (data descriptors)", "zipfile (CRCs in local headers)"])
def test_every_single_byte_change_gets_what_the_full_checks_give(tmp_path, kind):
    source, jobs = _dcp_items(tmp_path, 2)
    first, second = (source.read(i.relative_path, i.offset, i.length) for _, _, i in jobs)
    if kind.startswith("zipfile"):
        first, second = repacked(first), repacked(second)
    memo = ta.StructureMemo()
    assert _opened(first, memo)[0] == "archive"
    assert memo.layout_of(second, 0) is not None  # remembered: the changes below meet a primed memo
    differing, unchanged = 0, _opened(second, None, offset=7)
    for at in range(len(second)):
        for flip in (0x01, 0x80):
            changed = bytearray(second)
            changed[at] ^= flip
            changed = bytes(changed)
            full = _opened(changed, None, offset=7)
            assert _opened(changed, memo, offset=7) == full, f"byte {at} ^ {flip:#x}"
            differing += full != unchanged
    assert differing > len(second) // 4  # (the changes do matter to the full checks: refusals, other CRCs)


def test_a_local_crc_that_disagrees_is_refused_on_a_memo_hit(tmp_path):
    source, jobs = _dcp_items(tmp_path, 2)
    first, second = (repacked(source.read(i.relative_path, i.offset, i.length)) for _, _, i in jobs)
    memo = ta.StructureMemo()
    _opened(first, memo)
    bad = bytearray(second)
    bad[14] ^= 0xFF  # the first member's CRC in its local header
    with pytest.raises(FormatError, match="its local header declares"):
        ta.open_archive(BytesSource(bytes(bad), "item"), "", 0, len(bad), memo=memo)


def test_a_structurally_different_item_of_a_dcp_folder_is_refused(tmp_path):
    source, jobs = _dcp_items(tmp_path, 6)
    info = jobs[3][2]
    data = bytearray(source.read(info.relative_path, info.offset, info.length))
    central = data.index(b"PK\x01\x02")
    data[central + 10] = 8  # the first member's method in the directory: deflate
    with open(tmp_path / info.relative_path, "r+b") as f:
        f.seek(info.offset + central)
        f.write(data[central : central + 12])
    with pytest.raises(FormatError, match=r"is compressed \(zip method 8\)"):
        reader.read_index(LocalSource(str(tmp_path)), parallel=1)


class _CountingSource(BytesSource):
    def __init__(self, data: bytes) -> None:
        super().__init__(data, "file")
        self.reads = 0

    def read(self, rel: str, offset: int, length: int) -> bytes:
        self.reads += 1
        return bytes(self.data[offset : offset + length])


def test_the_read_ahead_window_serves_the_bytes_asked_for():
    data = bytes(range(256)) * 400
    source = _CountingSource(data)
    window = ReadWindow(source)
    spans = [(i * 100, 100) for i in range(300)]  # in file order, back to back
    assert all(window.read("", o, n, len(data)) == data[o : o + n] for o, n in spans)
    assert source.reads < 20
    source.reads = 0
    shuffled = [(o, n) for o, n in spans[::7]] + [(50, 3000), (len(data) - 10, 10), (0, 0)]
    assert all(window.read("", o, n, len(data)) == data[o : o + n] for o, n in shuffled)
    assert source.reads <= len(shuffled)  # out of order: never more than one read per item
