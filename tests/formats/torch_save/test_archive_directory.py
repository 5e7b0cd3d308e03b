"""The zip directory of a torch.save archive too big to read whole (a ZeRO-3
model-states file lists a storage record per parameter, 20k of them):

- `tail_directory` reads the end records and central directory from the end of the file and
  parses them once, exactly as zipfile does, and declines (None: zipfile reads it) anything
  unusual, entries with extra fields included;
- the local headers `checked_members` checks are read a window at a time (`HeaderReads`), and a
  damaged one is refused with the very sentence of a read of its own."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch

from ckptkit.errors import FormatError
from ckptkit.runner import torch_archive as ta
from ckptkit.runner import zip_directory
from ckptkit.storage.source import BytesSource
from helpers.zip_rewrites import central_damaged, cut, prefixed, two_disks, with_comment

FIELDS = (
    "filename",
    "orig_filename",
    "flag_bits",
    "compress_type",
    "compress_size",
    "file_size",
    "header_offset",
    "CRC",
)


def _big() -> bytes:
    """A torch.save archive past SMALL_ARCHIVE: many empty storages (like ZeRO-3's placeholders)
    and one larger one."""
    value = {f"p{i}": torch.empty(0, dtype=torch.bfloat16) for i in range(300)}
    value["big"] = torch.arange(40000, dtype=torch.float32)
    buf = io.BytesIO()
    torch.save(value, buf)
    data = buf.getvalue()
    assert len(data) > ta.SMALL_ARCHIVE
    return data


class _Counting(BytesSource):
    def __init__(self, data: bytes, label: str) -> None:
        super().__init__(data, label)
        self.reads = 0

    def read(self, rel: str, offset: int, length: int) -> bytes:
        self.reads += 1
        return super().read(rel, offset, length)


def _open(data: bytes, monkeypatch=None, fast: bool = True) -> ta.Archive:
    if not fast:
        monkeypatch.setattr(ta, "tail_directory", lambda *a: None)
        monkeypatch.setattr(zip_directory, "_GAP", -1)  # every header read on its own
    return ta.open_archive(BytesSource(data, "big.pt"), "")


def test_tail_directory_reads_what_zipfile_reads():
    data = _big()
    found = zip_directory.tail_directory(BytesSource(data, "big.pt"), "", 0, len(data))
    assert found is not None  # torch.save's big archives (zip64 end records included) take it
    entries, start = found
    zf = zipfile.ZipFile(io.BytesIO(data))
    assert start == zf.start_dir and len(entries) == len(zf.infolist()) > 300
    for mine, theirs in zip(entries, zf.infolist()):
        assert {f: getattr(mine, f) for f in FIELDS} == {f: getattr(theirs, f) for f in FIELDS}


def test_members_and_checks_agree_with_zipfiles_path_in_far_fewer_reads(monkeypatch):
    data = _big()
    source = _Counting(data, "big.pt")
    fast = ta.open_archive(source, "")
    assert source.reads < 10  # not one read per storage record
    slow = _open(data, monkeypatch, fast=False)
    assert fast.members == slow.members and fast.prefix == slow.prefix
    assert fast.checks() == slow.checks()


def _corrupt_extra(data: bytes) -> bytes:
    """The last central entry gets a 4-byte extra field that claims 9 bytes (zipfile: "Corrupt
    extra field"); the directory's size and the end records move with it."""
    last = data.rindex(b"PK\x01\x02")
    name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, last + 28)
    assert extra_len == 0 and comment_len == 0
    end_at = last + 46 + name_len
    entry = bytearray(data[last:end_at])
    struct.pack_into("<H", entry, 30, 4)
    out = bytearray(data[:last] + bytes(entry) + struct.pack("<HH", 0xCAFE, 9) + data[end_at:])
    z64 = out.rindex(b"PK\x06\x06")
    (size,) = struct.unpack_from("<Q", out, z64 + 40)
    struct.pack_into("<Q", out, z64 + 40, size + 4)
    struct.pack_into("<Q", out, out.rindex(b"PK\x06\x07") + 8, z64)
    end = out.rindex(b"PK\x05\x06")
    (small,) = struct.unpack_from("<I", out, end + 12)
    if small != 0xFFFFFFFF:
        struct.pack_into("<I", out, end + 12, small + 4)
    return bytes(out)


@pytest.mark.parametrize("damage", [with_comment, prefixed, two_disks, cut, central_damaged, _corrupt_extra])
def test_anything_unusual_is_left_to_zipfile(damage):
    data = damage(_big())
    assert zip_directory.tail_directory(BytesSource(data, "big.pt"), "", 0, len(data)) is None


@pytest.mark.parametrize("damage", [two_disks, cut, central_damaged, _corrupt_extra])
def test_damaged_directories_keep_their_message(damage, monkeypatch):
    data = damage(_big())
    with pytest.raises(FormatError) as fast:
        _open(data)
    with pytest.raises(FormatError) as slow:
        _open(data, monkeypatch, fast=False)
    assert str(fast.value) == str(slow.value)
    assert "damaged torch.save archive" in str(fast.value) or "too short" in str(fast.value)


def _local_damage(data: bytes, kind: str) -> bytes:
    """A local header among the many small records, damaged the way a hostile file would."""
    info = [i for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if i.filename.endswith("/data/150")][0]
    out = bytearray(data)
    at = info.header_offset
    if kind == "magic":
        out[at : at + 4] = b"PK\x09\x09"
    elif kind == "name":
        out[at + 30 + len(info.filename) - 1] ^= 1
    elif kind == "size":
        struct.pack_into("<I", out, at + 22, 7)
    return bytes(out)


@pytest.mark.parametrize("kind", ["magic", "name", "size"])
def test_a_damaged_local_header_read_in_a_window_keeps_its_sentence(kind, monkeypatch):
    data = _local_damage(_big(), kind)
    with pytest.raises(FormatError) as fast:
        _open(data)
    with pytest.raises(FormatError) as slow:
        _open(data, monkeypatch, fast=False)
    assert str(fast.value) == str(slow.value) and "data/150" in str(fast.value)
