"""DCP storage records are read as dcp.load reads them, or refused.

torch looks a storage record up by MetadataIndex's fqn and offset only (the index is a hint it
leaves out of comparisons and hashing): two records for one chunk that differ only in the hint
collapse to one when torch unpickles the .metadata, so dcp.load reads one of them. Crafted from
fsdp2_w2: such twins (after, before, without a hint, of a value) are refused under
tests/helpers/hostile.py's whole contract; wrong hints alone are read as dcp_to_torch_save reads them,
bit for bit.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import shutil
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers.agreement import DATA, FSDP2, assert_same, consolidated, needs, refused_everywhere

# ---- DCP: storage records torch looks up by name and offsets only ---------------------------


def _dcp_with_storage(tmp: Path, build: Callable[[object, type], dict]) -> Path:
    """A copy of fsdp2_w2 whose storage_data `build(md, MetadataIndex)` returns, pickled while
    MetadataIndex compares by identity (so two keys equal to torch both reach the file)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    needs(FSDP2)
    d = tmp / "ckpt"
    shutil.copytree(FSDP2, d)
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # trusted: our own copy of a fixture (test side only)
    eq, hash_ = MetadataIndex.__eq__, MetadataIndex.__hash__
    MetadataIndex.__eq__, MetadataIndex.__hash__ = object.__eq__, object.__hash__
    try:
        md.storage_data = build(md, MetadataIndex)
        with open(d / ".metadata", "wb") as f:
            pickle.dump(md, f)
    finally:
        MetadataIndex.__eq__, MetadataIndex.__hash__ = eq, hash_
    return d


def _equal_chunks(md) -> tuple[object, object]:
    """Two storage keys of one tensor whose chunks have the same size (a donor and a victim)."""
    for key, meta in md.state_dict_metadata.items():
        chunks = getattr(meta, "chunks", None)
        if chunks and len(chunks) == 2 and chunks[0].sizes == chunks[1].sizes:
            keys = sorted((k for k in md.storage_data if k.fqn == key), key=lambda k: tuple(k.offset))
            return keys[0], keys[1]
    pytest.skip("the fixture has no tensor of two equal chunks")


def _twin(where: str, index_of_twin: int | None = 99):
    def build(md, index_cls) -> dict:
        victim, donor = _equal_chunks(md)
        items = list(md.storage_data.items())  # (no lookups by key: the dict was hashed the usual way)
        twin = (index_cls(victim.fqn, victim.offset, index_of_twin), next(v for k, v in items if k is donor))
        at = {"after": len(items), "before": next(i for i, (k, _) in enumerate(items) if k is victim)}[where]
        items.insert(at, twin)
        return dict(items)

    return build


def _value_twin(md, index_cls) -> dict:
    items = list(md.storage_data.items())
    values = [(k, v) for k, v in items if k.offset is None]
    (victim, _), (_, donor_info) = values[0], values[1]
    return dict(items + [(index_cls(victim.fqn, None, 5), donor_info)])


DCP_ATTACKS = {
    "twin_listed_after_with_another_hint": _twin("after"),
    "twin_listed_before_with_another_hint": _twin("before"),
    "twin_without_a_hint": _twin("after", None),
    "twin_of_a_value": _value_twin,
}


@pytest.mark.parametrize("case", sorted(DCP_ATTACKS))
def test_two_storage_records_for_one_chunk_are_refused(tmp_path, case):
    d = _dcp_with_storage(tmp_path, DCP_ATTACKS[case])
    refused_everywhere(d, tmp_path, str(d / ".metadata"))


def test_a_chunk_twin_makes_dcp_load_read_the_last_record(tmp_path):
    """Why it is refused: dcp.load reads the donor's bytes into the victim's chunk."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    d = _dcp_with_storage(tmp_path, _twin("after"))
    dcp_to_torch_save(d, tmp_path / "truth.pt")
    dcp_to_torch_save(FSDP2, tmp_path / "honest.pt")
    truth, honest = (torch.load(tmp_path / n, weights_only=True) for n in ("truth.pt", "honest.pt"))
    with open(d / ".metadata", "rb") as f:
        victim, _ = _equal_chunks(pickle.load(f))
    assert not torch.equal(_flat(truth)[victim.fqn], _flat(honest)[victim.fqn])


def _flat(tree: dict, prefix: str = "") -> dict:
    """dcp_to_torch_save's nested dicts as DCP's dotted names."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_wrong_index_hints_are_read_as_dcp_load_reads_them(tmp_path):
    """The hint is only a hint: every record's index made wrong, each chunk is still its own."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def wrong_hints(md, index_cls) -> dict:
        return {index_cls(k.fqn, k.offset, 7): v for k, v in md.storage_data.items()}

    d = _dcp_with_storage(tmp_path, wrong_hints)
    dcp_to_torch_save(d, tmp_path / "truth.pt")
    flat = {
        k: v for k, v in _flat(torch.load(tmp_path / "truth.pt", weights_only=True)).items() if k.startswith("model.")
    }
    got = consolidated(d, tmp_path)
    got = {k if k in flat else f"model.{k}": v for k, v in got.items()}
    assert_same(flat, got)


def test_a_storage_record_offset_torch_cannot_hash_is_refused(tmp_path):
    def listed(md, index_cls) -> dict:
        out = {}
        for k, v in md.storage_data.items():
            key = index_cls(k.fqn, None, k.index)
            object.__setattr__(key, "offset", list(k.offset) if k.offset is not None else None)
            out[key] = v
        return out

    d = _dcp_with_storage(tmp_path, listed)
    refused_everywhere(d, tmp_path, str(d / ".metadata"))


# ---- DCP items: torch.save archives, their records checked on every road ---------------------


def _patched_member(item: bytes, suffix: str, data: bytes) -> bytes:
    """`item` (a stored zip) with member `*suffix` holding `data` (same length), its CRC32 fixed
    wherever the zip keeps it (local header, data descriptor, central directory)."""
    buf = bytearray(item)
    with zipfile.ZipFile(io.BytesIO(item)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
        start_dir = z.start_dir
    at = info.header_offset
    flags, name_len, extra_len = struct.unpack_from("<H", buf, at + 6)[0], *struct.unpack_from("<HH", buf, at + 26)
    begin = at + 30 + name_len + extra_len
    assert len(data) == info.file_size
    buf[begin : begin + len(data)] = data
    crc = struct.pack("<I", zlib.crc32(data))
    buf[at + 14 : at + 18] = crc
    if flags & 0x08:
        end = begin + len(data)
        at_crc = end + 4 if buf[end : end + 4] == b"PK\x07\x08" else end
        buf[at_crc : at_crc + 4] = crc
    pos = start_dir
    while buf[pos : pos + 4] == b"PK\x01\x02":
        n, e, c = struct.unpack_from("<HHH", buf, pos + 28)
        if bytes(buf[pos + 46 : pos + 46 + n]).decode() == info.filename:
            buf[pos + 16 : pos + 20] = crc
        pos += 46 + n + e + c
    return bytes(buf)


def test_an_item_record_torch_refuses_is_refused_among_items_laid_out_alike(tmp_path):
    """The last of 18 items laid out alike (so served by an item template, which compares the
    records' bytes too) says its byte order is 'LITTLE': torch.load refuses that item."""
    needs(FSDP2)
    d = tmp_path / "ckpt"
    shutil.copytree(FSDP2, d)
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # trusted: our own copy of a fixture (test side only)
    infos = sorted(
        (v for k, v in md.storage_data.items() if k.offset is not None and v.length == 1577),
        key=lambda v: (v.relative_path, v.offset),
    )
    assert len(infos) >= 8, "the fixture's items of one kind moved"
    last = infos[-1]
    path = d / last.relative_path
    raw = path.read_bytes()
    item = raw[last.offset : last.offset + last.length]
    path.write_bytes(
        raw[: last.offset] + _patched_member(item, "/byteorder", b"LITTLE") + raw[last.offset + last.length :]
    )
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with pytest.raises(BaseException) as caught:  # (torch's CheckpointException is no Exception)
        dcp_to_torch_save(d, tmp_path / "truth.pt")
    assert "endianness" in f"{caught.value} {getattr(caught.value, 'failures', '')}"
    refused_everywhere(d, tmp_path, str(path))


# ---- rank-local metadata: files that describe one key two ways -------------------------------

RANK_LOCAL = DATA / "dcp_rank_local_w2"


def _grown(meta) -> None:
    meta.size = torch.Size([meta.size[0] + 1, *meta.size[1:]])


def _halved(meta) -> None:
    meta.properties = dataclasses.replace(meta.properties, dtype=torch.float16)


RANK_CONFLICTS = {"another_shape": _grown, "another_dtype": _halved, "a_value": None}


@pytest.mark.parametrize("case", sorted(RANK_CONFLICTS))
def test_rank_local_files_describing_one_tensor_two_ways_are_refused(tmp_path, case):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    needs(RANK_LOCAL)
    d = tmp_path / "ckpt"
    shutil.copytree(RANK_LOCAL, d)
    with open(d / "__1.metadata", "rb") as f:
        md = pickle.load(f)  # trusted: our own copy of a fixture (test side only)
    with open(d / "__0.metadata", "rb") as f:
        shared = next(
            k
            for k, m in pickle.load(f).state_dict_metadata.items()
            if k in md.state_dict_metadata and getattr(m, "chunks", None)
        )
    change = RANK_CONFLICTS[case]
    if change is None:
        md.state_dict_metadata[shared] = BytesStorageMetadata()
    else:
        change(md.state_dict_metadata[shared])
    with open(d / "__1.metadata", "wb") as f:
        pickle.dump(md, f)
    refused_everywhere(d, tmp_path, str(d / "__1.metadata"))
