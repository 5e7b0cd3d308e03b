"""The torch.save container: a stored (uncompressed) zip whose data.pkl rebuilds tensors over raw
storages in data/<key>.

We parse the zip with the standard library over exact byte ranges, unpickle data.pkl with the
restricted unpickler, and describe each tensor as a byte range of its storage member, so a
tensor's bytes can be read later with one positional read and no torch.load.
"""
from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from ...errors import CkptkitError, FormatError
from ...index.dtypes import dtype_name
from ...index.geometry import row_major_strides
from ...index.types import IntegrityCheck, Location
from ...safeload import RawStorage, StorageRef, TensorRef, restricted_loads, storage_pid, typed_storage
from ...storage.source import RangeFile, Source

ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class Member:
    name: str
    data_offset: int  # absolute, in the containing file
    size: int
    crc32: int
    compressed: bool


@dataclass
class Archive:
    source: Source
    file: str
    prefix: str
    members: dict[str, Member]

    @property
    def label(self) -> str:
        return self.source.label(self.file)

    def storage_member(self, key: str) -> Member:
        name = f"{self.prefix}/data/{key}"
        try:
            return self.members[name]
        except KeyError:
            raise FormatError(f"{self.label}: archive has no storage record {name}") from None

    def checks(self) -> list[IntegrityCheck]:
        return [IntegrityCheck(self.file, m.data_offset, m.size, m.crc32, f"zip member {m.name}")
                for m in self.members.values() if not m.compressed]


def open_archive(source: Source, rel: str, offset: int = 0, length: int | None = None) -> Archive:
    """Parse the zip directory of a torch.save archive at [offset, offset+length) of `rel`."""
    if length is None:
        length = source.size(rel) - offset
    label = source.label(rel)
    if length < 22:
        raise FormatError(f"{label}: {length} bytes at offset {offset} are too short to be a torch.save archive")
    head = source.read(rel, offset, min(4, length))
    if head != ZIP_MAGIC:
        if head[:1] == b"\x80" or head[:2] == b"\x8a\x0a":
            raise FormatError(f"{label}: legacy (pre-1.6, non-zip) torch.save format is not supported; "
                              f"re-save it with a current torch")
        raise FormatError(f"{label}: not a torch.save archive (no zip header at offset {offset})")
    try:
        zf = zipfile.ZipFile(io.BufferedReader(RangeFile(source, rel, offset, length), buffer_size=65536))
        infos = zf.infolist()
    except CkptkitError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error, NotImplementedError,
            OverflowError) as exc:  # a damaged directory surfaces as any of these (names: UnicodeDecodeError)
        raise FormatError(f"{label}: damaged torch.save archive at offset {offset} "
                          f"({type(exc).__name__}: {str(exc)[:120]})") from None
    members: dict[str, Member] = {}
    for info in infos:
        if info.header_offset < 0 or info.compress_size < 0:
            raise FormatError(f"{label}: zip member {info.filename} has a damaged directory entry")
        if info.header_offset + 30 > length:
            raise FormatError(f"{label}: zip member {info.filename} starts past the end of the archive")
        local = source.read(rel, offset + info.header_offset, 30)
        if local[:4] != ZIP_MAGIC:
            raise FormatError(f"{label}: zip member {info.filename} has a damaged local header")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        data_offset = info.header_offset + 30 + name_len + extra_len
        if data_offset + info.compress_size > length:
            raise FormatError(f"{label}: zip member {info.filename} runs past the end of the archive "
                              f"(truncated file?)")
        members[info.filename] = Member(info.filename, offset + data_offset, info.file_size,
                                        info.CRC, info.compress_type != zipfile.ZIP_STORED)
    pkls = [n for n in members if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise FormatError(f"{label}: torch.save archive must hold exactly one <root>/data.pkl, found {len(pkls)}")
    prefix = pkls[0][: -len("/data.pkl")]
    return Archive(source, rel, prefix, members)


def _read_member(archive: Archive, name: str) -> bytes:
    m = archive.members.get(name)
    if m is None:
        raise FormatError(f"{archive.label}: archive has no record {name}")
    if m.compressed:
        raise FormatError(f"{archive.label}: record {name} is compressed; torch.save never compresses")
    return archive.source.read(archive.file, m.data_offset, m.size)


def load_structure(archive: Archive, eager: bool = False) -> Any:
    """Unpickle data.pkl. Lazy: tensors become TensorRefs; eager: SmallTensors holding their
    bytes (small values only)."""
    loaded: dict[str, Any] = {}

    def persistent_load(pid: Any) -> Any:
        key, dtype, numel = storage_pid(pid, archive.label)
        member = archive.storage_member(key)
        nbytes = numel * dtype.itemsize
        if member.size < nbytes:
            raise FormatError(f"{archive.label}: storage {key} holds {member.size} bytes, "
                              f"the pickle expects {nbytes}")
        if not eager:
            return typed_storage(StorageRef(key, dtype, numel), dtype)
        if key not in loaded:
            loaded[key] = RawStorage(archive.source.read(archive.file, member.data_offset, nbytes))
        return typed_storage(loaded[key], dtype)

    data = _read_member(archive, f"{archive.prefix}/data.pkl")
    return restricted_loads(data, archive.label, persistent_load)


def tensor_span_elems(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from the first to the last element of a strided view (0 when empty)."""
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def tensor_location(archive: Archive, ref: TensorRef, what: str) -> tuple[str, Location]:
    """The dtype name and byte location of a lazily described tensor, bounds-checked."""
    member = archive.storage_member(ref.storage.key)
    item = ref.dtype.itemsize
    if any(st < 0 for st in ref.stride):
        raise FormatError(f"{archive.label}: tensor {what} has negative strides")
    span = tensor_span_elems(ref.size, ref.stride)
    start = ref.storage_offset * item
    if start + span * item > member.size:
        raise FormatError(f"{archive.label}: tensor {what} needs bytes up to {start + span * item} "
                          f"of storage {ref.storage.key}, which holds {member.size}")
    stride = None if is_contiguous(ref.size, ref.stride) else tuple(ref.stride)
    return dtype_name(ref.dtype), Location(archive.file, member.data_offset + start, span * item,
                                          stride=stride)


def _open_bytes(data: bytes | bytearray, label: str) -> Archive:
    from ...storage.checksum import crc32

    archive = open_archive(_BytesSource(data, label), "")
    view = memoryview(data)
    for m in archive.members.values():  # in memory already: checking costs one fast pass
        if not m.compressed and crc32(view[m.data_offset:m.data_offset + m.size]) & 0xFFFFFFFF != m.crc32:
            raise FormatError(f"{label}: damaged item: zip member {m.name} fails its CRC32 check")
    return archive


def load_bytes_archive(data: bytes, label: str) -> Any:
    """Eagerly load a torch.save archive held in memory (a decompressed DCP value item)."""
    return load_structure(_open_bytes(data, label), eager=True)


def load_bytes_tensor(data: bytearray, label: str) -> Any:
    """The tensor a torch.save archive held in memory stores (a decompressed DCP tensor item),
    as a torch tensor viewing `data` itself (no copy); None if it holds something else."""
    import torch

    from ...index.dtypes import torch_dtype

    archive = _open_bytes(data, label)
    ref = load_structure(archive, eager=False)
    if not isinstance(ref, TensorRef):
        return None
    dtype, loc = tensor_location(archive, ref, "item")
    tdtype = torch_dtype(dtype)
    flat = torch.frombuffer(data, dtype=tdtype, count=loc.length // tdtype.itemsize, offset=loc.offset) \
        if loc.length else torch.empty(0, dtype=tdtype)
    return flat.as_strided(tuple(ref.size), loc.stride or row_major_strides(tuple(ref.size)))


class _BytesSource:
    """A Source over bytes in memory."""

    def __init__(self, data: bytes, label: str) -> None:
        self.root = label
        self._data = memoryview(data)

    def label(self, rel: str) -> str:
        return self.root

    def size(self, rel: str) -> int:
        return len(self._data)

    def read(self, rel: str, offset: int, length: int) -> bytes:
        if offset + length > len(self._data):
            raise FormatError(f"{self.root}: data ends before byte {offset + length}")
        return bytes(self._data[offset:offset + length])

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        buf[:] = self.read(rel, offset, len(buf))

    def exists(self, rel: str) -> bool:
        return True

    def isdir(self, rel: str = "") -> bool:
        return False

    def listdir(self, rel: str = "") -> list[str]:
        return []
