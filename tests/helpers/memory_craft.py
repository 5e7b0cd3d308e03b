"""Crafting hostile checkpoints for tests/hostile/memory/test_memory_bounds.py, as an attacker would.

torch.save archives are written from scratch (our own pickle of torch's rebuild calls, so any
view, storage size or offset can be declared) or through torch.save with a view object whose
pickle says what we want; zip directories are then edited with struct; DCP items are replaced
by appending new bytes and pointing the metadata at them; zstd streams are compressed from
zeros without holding them in memory.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.corrupt import append_bytes, load_md, replace_storage, save_md, storage_key

CENTRAL = b"PK\x01\x02"
LOCAL = b"PK\x03\x04"


# ---- torch.save archives with any view ----------------------------------------------------------


@dataclass(frozen=True)
class FakeStorage:
    key: str
    numel: int
    cls: str = "FloatStorage"


class FakeTensor:
    """Pickles as torch._utils._rebuild_tensor_v2 over a FakeStorage, with any offset/size/stride."""

    def __init__(self, storage: FakeStorage, offset: int, size, stride) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)

    def __reduce__(self):
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, self.offset, self.size, self.stride, False, collections.OrderedDict()),
        )


class RawView:
    """Pickles through torch.save as a view of `base`'s real storage with any offset/size/stride
    (torch itself would refuse to build most of them)."""

    def __init__(self, base: torch.Tensor, offset: int, size, stride) -> None:
        self.base, self.offset, self.size, self.stride = base, offset, tuple(size), tuple(stride)

    def __reduce__(self):
        storage = torch.storage.TypedStorage(
            wrap_storage=self.base.untyped_storage(), dtype=self.base.dtype, _internal=True
        )
        return (
            torch._utils._rebuild_tensor_v2,
            (storage, self.offset, torch.Size(self.size), self.stride, False, collections.OrderedDict()),
        )


def torch_save_archive(obj, storages: dict[str, bytes], root: str = "archive") -> bytes:
    """A torch.save zip of `obj` whose FakeStorages are the members data/<key> given here."""
    buf = io.BytesIO()

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, FakeStorage):
                return ("storage", getattr(torch, o.cls), o.key, "cpu", o.numel)
            return None

    Pickler(buf, protocol=2).dump(obj)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{root}/data.pkl", buf.getvalue())
        zf.writestr(f"{root}/byteorder", "little")
        for key, data in storages.items():
            zf.writestr(f"{root}/data/{key}", data)
        zf.writestr(f"{root}/version", "3\n")
    return out.getvalue()


def torch_save_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---- zip directory edits ---------------------------------------------------------------------


def _entries(data: bytes, sig: bytes, name: str) -> list[int]:
    out, pos = [], 0
    raw = name.encode()
    while True:
        pos = data.find(sig, pos)
        if pos < 0:
            return out
        name_at = pos + (46 if sig == CENTRAL else 30)
        len_at = pos + (28 if sig == CENTRAL else 26)
        (n,) = struct.unpack_from("<H", data, len_at)
        if data[name_at : name_at + n] == raw:
            out.append(pos)
        pos += 4


def patch_member(
    data: bytes,
    name: str,
    *,
    central: bool = True,
    method: int | None = None,
    csize: int | None = None,
    usize: int | None = None,
    header_offset: int | None = None,
    flags: int | None = None,
) -> bytes:
    """Rewrite fields of member `name`'s central directory entry (or its local header)."""
    buf = bytearray(data)
    sig = CENTRAL if central else LOCAL
    (pos,) = _entries(data, sig, name)
    base = 0 if central else -2  # the local header lacks "version made by"
    if flags is not None:
        struct.pack_into("<H", buf, pos + 8 + base, flags)
    if method is not None:
        struct.pack_into("<H", buf, pos + 10 + base, method)
    if csize is not None:
        struct.pack_into("<I", buf, pos + 20 + base, csize)
    if usize is not None:
        struct.pack_into("<I", buf, pos + 24 + base, usize)
    if header_offset is not None:
        assert central
        struct.pack_into("<I", buf, pos + 42, header_offset)
    return bytes(buf)


def local_header_offset(data: bytes, name: str) -> int:
    (pos,) = _entries(data, LOCAL, name)
    return pos


# ---- DCP items -------------------------------------------------------------------------------


def save_dcp(path: Path, state: dict, zstd: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        writer = FileSystemWriter(str(path), _extensions=[ZStandard()])
    else:
        writer = FileSystemWriter(str(path))
    dcp.save(state, storage_writer=writer, no_dist=True)


def replace_item(folder: Path, fqn: str, data: bytes, offsets=None) -> str:
    """Point the storage record of `fqn` at `data`, appended to its data file; the file's name."""
    md = load_md(folder)
    mi = storage_key(md, fqn, offsets)
    info = md.storage_data[mi]
    start = append_bytes(folder / info.relative_path, data)
    replace_storage(md, mi, offset=start, length=len(data))
    save_md(folder, md)
    return info.relative_path


def set_declared(folder: Path, fqn: str, size) -> None:
    """Declare tensor `fqn` (one chunk at the origin) to have `size` in .metadata."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = load_md(folder)
    meta = md.state_dict_metadata[fqn]
    mi = storage_key(md, fqn)
    info = md.storage_data.pop(mi)
    origin = torch.Size([0] * len(size))
    chunk = ChunkStorageMetadata(offsets=origin, sizes=torch.Size(size))
    md.state_dict_metadata[fqn] = dataclasses.replace(meta, size=torch.Size(size), chunks=[chunk])
    md.storage_data[MetadataIndex(fqn, origin, 0)] = info
    save_md(folder, md)


def zstd_of_zeros(nbytes: int, head: bytes = b"") -> bytes:
    """A zstd frame that decodes to `head` then zeros, `nbytes` in all (compressed chunk by chunk)."""
    import zstandard

    comp = zstandard.ZstdCompressor(level=1).compressobj()
    parts = [comp.compress(head)]
    zeros = bytes(16 << 20)
    left = nbytes - len(head)
    while left > 0:
        n = min(left, len(zeros))
        parts.append(comp.compress(zeros[:n]))
        left -= n
    parts.append(comp.flush())
    return b"".join(parts)


def zstd_of(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)
