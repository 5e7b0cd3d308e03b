"""The fast path for small torch.save archives (a DCP checkpoint of 100k small tensors
is 100k archives to open while indexing).

- `plain_directory` parses the zip directory of an archive torch.save wrote exactly as zipfile
  does, and declines (None: zipfile reads it) anything it does not handle;
- `StructureMemo` unpickles a data.pkl once per distinct bytes, and a hit still checks the
  archive's own storage records."""

from __future__ import annotations

import io
import pathlib
import zipfile

import pytest
import torch

from ckptkit.errors import FormatError
from ckptkit.runner import torch_archive as ta
from ckptkit.runner.zip_directory import plain_directory
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


def saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


ARCHIVES = {
    "small tensor": lambda: saved(torch.arange(32, dtype=torch.float32)),
    "bf16 matrix": lambda: saved(torch.ones(3, 5, dtype=torch.bfloat16)),
    "dict of tensors": lambda: saved({"a": torch.zeros(2), "b": torch.ones(3, dtype=torch.int64), "step": 3}),
    "empty tensor": lambda: saved(torch.empty(0)),
    "view of a storage": lambda: saved(torch.arange(10.0)[2:7]),
}


@pytest.mark.parametrize("name", list(ARCHIVES))
def test_plain_directory_reads_what_zipfile_reads(name):
    data = ARCHIVES[name]()
    plain = plain_directory(data)
    assert plain is not None  # torch.save's archives (zip64 end records included) take the fast path
    entries, start = plain
    zf = zipfile.ZipFile(io.BytesIO(data))
    assert start == zf.start_dir
    assert len(entries) == len(zf.infolist())
    for mine, theirs in zip(entries, zf.infolist()):
        assert {f: getattr(mine, f) for f in FIELDS} == {f: getattr(theirs, f) for f in FIELDS}


@pytest.mark.parametrize("damage", [with_comment, prefixed, two_disks, cut, central_damaged])
def test_anything_unusual_is_left_to_zipfile(damage):
    data = damage(ARCHIVES["small tensor"]())
    assert plain_directory(data) is None


@pytest.mark.parametrize("damage", [two_disks, cut, central_damaged])
def test_damaged_directories_keep_their_message(damage):
    data = damage(ARCHIVES["small tensor"]())
    with pytest.raises(FormatError, match="damaged torch.save archive|not a torch.save archive|too short"):
        ta.open_archive(BytesSource(data, "item"), "", 0, len(data))


def _shrunk_storage(data: bytes, keep: int) -> bytes:
    """The same archive (same data.pkl) whose storage record holds only `keep` bytes."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for info in src.infolist():
            body = src.read(info)
            if "/data/" in info.filename:
                body = body[:keep]
            zf.writestr(info.filename, body)
    return out.getvalue()


def test_a_memo_hit_still_checks_this_archives_storage():
    good = saved(torch.arange(4, dtype=torch.float32))
    short = _shrunk_storage(good, 8)  # data.pkl expects 16 bytes
    memo = ta.StructureMemo()
    first = ta.load_structure(ta.open_archive(BytesSource(good, "a"), "", 0, len(good)), memo=memo)
    again = ta.load_structure(ta.open_archive(BytesSource(good, "b"), "", 0, len(good)), memo=memo)
    assert again is first  # unpickled once
    with pytest.raises(FormatError, match="holds 8 bytes, the pickle expects 16"):
        ta.load_structure(ta.open_archive(BytesSource(short, "c"), "", 0, len(short)), memo=memo)


def test_a_refused_pickle_is_never_remembered():
    good = saved(torch.arange(4, dtype=torch.float32))
    short = _shrunk_storage(good, 8)
    memo = ta.StructureMemo()
    for _ in range(2):  # refused both times: the failure left nothing behind to be served
        with pytest.raises(FormatError, match="the pickle expects 16"):
            ta.load_structure(ta.open_archive(BytesSource(short, "c"), "", 0, len(short)), memo=memo)
    ta.load_structure(ta.open_archive(BytesSource(good, "a"), "", 0, len(good)), memo=memo)


def _item_bytes(fetcher, entry) -> bytes:
    from ckptkit.formats.torch_save.archive_writer import LazyTensor, write_archive_to

    buf = io.BytesIO()
    write_archive_to(buf, LazyTensor(entry), fetcher, slab_bytes=1 << 20)
    return buf.getvalue()


def test_items_from_templates_are_zipfiles_bytes(monkeypatch):
    """A DCP item written from its template equals, byte for byte, what zipfile writes for it, for
    every tensor of a real checkpoint (dtypes, shapes, empty tensors); and torch loads it."""
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.formats.torch_save import archive_writer as aw
    from ckptkit.runner.fetch import Fetcher

    opened = open_checkpoint(str(pathlib.Path(__file__).resolve().parents[3] / "fixtures" / "data" / "fsdp2_w2"))
    fetcher = Fetcher(opened.source, index=opened.index)
    entries = [e for e in opened.index.tensors.values() if e.nbytes <= aw.SMALL_ARCHIVE]
    assert len(entries) > 10
    used = []
    real = aw._write_from_template
    monkeypatch.setattr(aw, "_write_from_template", lambda *a: used.append(real(*a)) or used[-1])
    fast = [_item_bytes(fetcher, e) for e in entries]
    assert sum(used) == len(entries)  # every one took the template
    monkeypatch.setattr(aw, "_write_from_template", lambda *a: False)
    slow = [_item_bytes(fetcher, e) for e in entries]
    assert fast == slow
    for entry, data in zip(entries, fast):
        assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), fetcher.fetch(entry))


def test_a_template_that_zipfile_disagrees_with_is_not_used(monkeypatch):
    from ckptkit.formats.torch_save import archive_writer as aw

    monkeypatch.setattr(aw, "_TEMPLATES", {})
    real = aw._zip_of
    calls = []

    def drifting(pickle_bytes, data):  # zipfile writing something the template cannot follow
        calls.append(1)
        return real(pickle_bytes, data) + (b"" if len(calls) == 1 else b"!")

    monkeypatch.setattr(aw, "_zip_of", drifting)
    assert aw._template(b"\x80\x02N.", 16) is None
    assert aw._TEMPLATES[(b"\x80\x02N.", 16)] is None
