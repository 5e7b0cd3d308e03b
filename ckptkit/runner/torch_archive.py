"""The torch.save container: a stored (uncompressed) zip whose data.pkl rebuilds tensors over raw
storages in data/<key>.

We parse the zip over exact byte ranges (the plain directory torch.save writes with struct, read
once from the end of the file; anything else with the standard library), unpickle data.pkl with the
restricted unpickler, and describe each tensor as a byte range of its storage member, so a
tensor's bytes can be read later with one positional read and no torch.load.

Every size and offset the zip directory or the pickle declares is checked before anything is
read or allocated: members are stored (never compressed), lie inside the archive's byte range
before its central directory, do not overlap, and their local headers agree with the directory;
a tensor's view (offset, size, stride) lies inside its storage member's data, so a piece never
reads zip headers or a neighbour's bytes.

This module opens an archive and loads its data.pkl; the parts live beside it: zip_directory
(the directory and its members' checks), structure_memo (what same-shaped archives share) and
archive_values (tensor locations, values loaded whole). Readers import all of it from here.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import FormatError
from ..index.types import Location
from ..safeload import (
    RawStorage,
    StorageRef,
    TensorRef,
    fenced_torch_save_loads,
    restricted_loads,
    storage_pid,
    typed_storage,
)
from ..storage.source import BytesSource, Source
from .archive_records import StorageKinds, archive_folder, check_records, record_reader
from .archive_values import (
    check_whole,
    empty_view,
    is_contiguous,
    load_values,
    tensor_location,
    tensor_span_elems,
    whole_bytes,
)
from .structure_memo import LastStructure, StructureMemo
from .zip_directory import (
    ZIP_MAGIC,
    Archive,
    HeaderReads,
    Member,
    checked_members,
    plain_directory,
    tail_directory,
    zipfile_directory,
)

# what readers and the fetcher take from here (the parts live in zip_directory, structure_memo and
# archive_values)
__all__ = [
    "SMALL_ARCHIVE",
    "ZIP_MAGIC",
    "Archive",
    "LastStructure",
    "Member",
    "StructureMemo",
    "check_crcs",
    "empty_view",
    "is_contiguous",
    "item_tensor",
    "load_bytes_archive",
    "load_structure",
    "load_values",
    "open_archive",
    "open_item",
    "tensor_location",
    "tensor_span_elems",
    "whole_bytes",
]

# an archive this small (a DCP item of a small tensor) is read in one request, and its zip
# directory, headers and data.pkl parsed from that copy: the size of zipfile's read buffer anyway
SMALL_ARCHIVE = 1 << 16


def open_archive(
    source: Source,
    rel: str,
    offset: int = 0,
    length: int | None = None,
    memo: StructureMemo | None = None,
    data: bytes | None = None,
) -> Archive:
    """Parse the zip directory of a torch.save archive at [offset, offset+length) of `rel`.
    `data`: those very bytes, already read (a run of small items read at once); `memo` serves the
    directory of an archive laid out exactly like one already checked (see ZipLayout)."""
    if length is None:
        length = source.size(rel) - offset
    if length < 22:
        raise FormatError(
            f"{source.label(rel)}: {length} bytes at offset {offset} are too short to be a torch.save archive"
        )
    copy = _small_copy(source, rel, offset, length, data)
    if copy is not None and memo is not None:
        known = memo.layout_of(copy, offset)
        if known is not None:
            return _with_records(Archive(source, rel, known[1], known[0], copy=copy, base=offset))
    label = source.label(rel)
    head = copy[:4] if copy is not None else source.read(rel, offset, min(4, length))
    if head != ZIP_MAGIC:
        if head[:1] == b"\x80" or head[:2] == b"\x8a\x0a":
            raise FormatError(
                f"{label}: legacy (pre-1.6, non-zip) torch.save format is not supported; "
                f"re-save it with a current torch"
            )
        raise FormatError(f"{label}: not a torch.save archive (no zip header at offset {offset})")
    plain = plain_directory(copy) if copy is not None else tail_directory(source, rel, offset, length)
    infos, start_dir = plain if plain is not None else zipfile_directory(source, rel, offset, length, copy, label)
    read: Callable[[int, int], bytes] = (
        (lambda at, n: copy[at : at + n])
        if copy is not None
        else HeaderReads(
            lambda at, n: source.read(rel, offset + at, n),
            infos,
            min(start_dir, length) if offset + length <= source.size(rel) else 0,
        ).read
    )
    members = checked_members(read, offset, length, label, infos, start_dir)
    pkls = [n for n in members if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise FormatError(f"{label}: torch.save archive must hold exactly one <root>/data.pkl, found {len(pkls)}")
    prefix = archive_folder(list(members), label)  # (torch.load's folder: the first member's, holding them all)
    archive = _with_records(Archive(source, rel, prefix, members, copy=copy, base=offset))
    if memo is not None and plain is not None and copy is not None:
        memo.remember_layout(copy, offset, plain[1], members, prefix)
    return archive


def _small_copy(source: Source, rel: str, offset: int, length: int, data: bytes | None) -> bytes | None:
    """The whole archive in memory when it is small: `data` when those are its bytes, else read
    in one request; None for a big one (or one said to run past its file's end)."""
    if data is not None and len(data) == length <= SMALL_ARCHIVE:
        return data
    if length <= SMALL_ARCHIVE and offset + length <= source.size(rel):
        return source.read(rel, offset, length)
    return None


def _with_records(archive: Archive) -> Archive:
    """`archive`, once its byteorder, version and alignment records read as torch.load reads them."""
    check_records(
        archive.label, archive.prefix, archive.members, record_reader(archive.members, archive.prefix, archive.read)
    )
    return archive


def _read_member(archive: Archive, name: str) -> bytes:
    m = archive.members.get(name)
    if m is None:
        raise FormatError(f"{archive.label}: archive has no record {name}")
    if m.compressed:
        raise FormatError(f"{archive.label}: record {name} is compressed; torch.save never compresses")
    return archive.read(m.data_offset, m.size)


def load_structure(archive: Archive, eager: bool = False, memo: StructureMemo | LastStructure | None = None) -> Any:
    """Unpickle data.pkl. Lazy: tensors become TensorRefs; eager: SmallTensors over their
    storage's bytes, read once per storage and shared by its views (small values only).
    `memo` (lazy loads only) serves a data.pkl already loaded with the same bytes: the same
    structure (only ever read), its storages checked against this archive's members."""
    data = _read_member(archive, f"{archive.prefix}/data.pkl")
    if memo is not None and not eager:
        hit = memo.get(data)
        if hit is not None:
            for pid in hit[1]:
                _checked_storage(archive, pid)  # this archive's storage members, checked as a first load would
            return hit[0]
    loaded: dict[str, Any] = {}
    pids: list[Any] = []
    kinds = StorageKinds(archive.label)

    def persistent_load(pid: Any) -> Any:
        pids.append(pid)
        key, dtype, numel, member, nbytes = _checked_storage(archive, pid)
        kinds.check(key, dtype, numel)
        if not eager:
            return typed_storage(StorageRef(key, dtype, numel), dtype)
        if key not in loaded:
            loaded[key] = RawStorage(archive.read(member.data_offset, nbytes))
        return typed_storage(loaded[key], dtype)

    value = None if eager else fenced_torch_save_loads(data, persistent_load)  # (C speed, fenced)
    if value is None:  # declined (or None itself): the restricted machine reads it, and words any refusal
        pids.clear()
        value = restricted_loads(data, archive.label, persistent_load)
    if memo is not None and not eager:
        memo.put(data, value, pids)
    if eager:  # views share their storage's bytes; what they would copy is counted here
        check_whole(archive.label, whole_bytes(value))
    return value


def _checked_storage(archive: Archive, pid: Any) -> tuple[str, Any, int, Member, int]:
    """The storage a persistent id names (key, dtype, element count), its member in this archive
    and its byte size, which must be the member's exactly: torch.load refuses any other size (a
    longer record read as a shorter type's elements would be other values than the ones saved)."""
    key, dtype, numel = storage_pid(pid, archive.label)
    member = archive.storage_member(key)
    nbytes = numel * dtype.itemsize
    if numel < 0 or member.size != nbytes:
        raise FormatError(f"{archive.label}: storage {key} holds {member.size} bytes, the pickle expects {nbytes}")
    return key, dtype, numel, member, nbytes


# ---- archives held in memory or decoded from a compressed DCP item --------------------------

CRC_WINDOW = 1 << 20


def check_crcs(archive: Archive) -> None:
    """Recompute every member's CRC32 (the zstd frame of a DCP item carries no checksum of its
    own), reading through the archive's source in bounded windows, members in file order."""
    from ..storage.checksum import crc32

    view = getattr(archive.source, "view", None)
    buf = bytearray(min(CRC_WINDOW, max((m.size for m in archive.members.values()), default=0)))
    for m in sorted(archive.members.values(), key=lambda m: m.data_offset):
        crc, pos, end = 0, m.data_offset, m.data_offset + m.size
        while pos < end:
            n = min(len(buf), end - pos)
            if view is not None:
                chunk = view(pos, n)
            else:
                chunk = memoryview(buf)[:n]
                archive.source.readinto(archive.file, pos, chunk)
            crc = crc32(chunk, crc)
            pos += n
        if crc & 0xFFFFFFFF != m.crc32:
            raise FormatError(f"{archive.label}: damaged item: zip member {m.name} fails its CRC32 check")


def open_item(source: Any, label: str) -> Archive:
    """A torch.save archive that is a whole Source of its own (bytes in memory, or a decoded
    item streamed in windows), its CRC32s checked."""
    archive = open_archive(source, "")
    check_crcs(archive)
    return archive


def load_bytes_archive(data: bytes, label: str) -> Any:
    """Eagerly load a torch.save archive held in memory (a decompressed DCP value item)."""
    return load_structure(open_item(BytesSource(data, label), label), eager=True)


def item_tensor(archive: Archive, what: str) -> tuple[TensorRef, str, Location] | None:
    """The tensor an item's archive stores: its reference, dtype name and location inside the
    archive's source (checked like any view); None if it holds something else."""
    ref = load_structure(archive, eager=False)
    if not isinstance(ref, TensorRef):
        return None
    dtype, loc = tensor_location(archive, ref, what)
    return ref, dtype, loc
