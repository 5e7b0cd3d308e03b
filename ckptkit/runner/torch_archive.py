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
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NamedTuple

from ..errors import CkptkitError, FormatError
from ..index.dtypes import ITEMSIZE, dtype_name
from ..index.geometry import row_major_strides, strided_span
from ..index.types import IntegrityCheck, Location
from ..safeload import (
    RawStorage,
    StorageRef,
    TensorRef,
    fenced_torch_save_loads,
    restricted_loads,
    storage_pid,
    typed_storage,
)
from ..storage.source import BytesSource, RangeFile, Source
from . import limits
from .archive_records import StorageKinds, archive_folder, check_records, record_reader
from ..torch_types import SmallTensor, view_problem

ZIP_MAGIC = b"PK\x03\x04"
# an archive this small (a DCP item of a small tensor) is read in one request, and its zip
# directory, headers and data.pkl parsed from that copy: the size of zipfile's read buffer anyway
SMALL_ARCHIVE = 1 << 16


class Member(NamedTuple):
    """A stored zip member (a tuple: a DCP item has seven, built for each of 100k items)."""

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
    values_built: int = 0  # bytes of the tensors load_values built from this archive so far
    values_read: int = 0  # bytes load_values read for them
    copy: bytes | None = None  # the whole archive, when it was small enough to read at once
    base: int = 0  # the archive's offset in its file

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of the file: from the archive's copy when they lie in it."""
        start = offset - self.base
        if self.copy is not None and 0 <= start and 0 <= length and start + length <= len(self.copy):
            return self.copy[start : start + length]
        return self.source.read(self.file, offset, length)

    @cached_property
    def label(self) -> str:  # (kept: every storage a pickle names passes it to its checks)
        return self.source.label(self.file)

    def storage_member(self, key: str) -> Member:
        name = f"{self.prefix}/data/{key}"
        try:
            return self.members[name]
        except KeyError:
            raise FormatError(f"{self.label}: archive has no storage record {name}") from None

    def checks(self) -> list[IntegrityCheck]:
        return [
            _new_tuple(IntegrityCheck, (self.file, m.data_offset, m.size, m.crc32, f"zip member {m.name}"))
            for m in self.members.values()
            if not m.compressed
        ]


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
    directory of an archive laid out exactly like one already checked (see _Layout)."""
    if length is None:
        length = source.size(rel) - offset
    if length < 22:
        raise FormatError(
            f"{source.label(rel)}: {length} bytes at offset {offset} are too short to be a torch.save archive"
        )
    if data is not None and len(data) == length <= SMALL_ARCHIVE:
        copy: bytes | None = data
    else:
        copy = (
            source.read(rel, offset, length)
            if length <= SMALL_ARCHIVE and offset + length <= source.size(rel)
            else None
        )
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
    plain = _plain_directory(copy) if copy is not None else _tail_directory(source, rel, offset, length)
    try:
        if plain is not None:
            infos, start_dir = plain
        else:
            raw = (
                RangeFile(BytesSource(copy, label), "", 0, length)
                if copy is not None
                else RangeFile(source, rel, offset, length)
            )
            zf = zipfile.ZipFile(io.BufferedReader(raw, buffer_size=65536))
            infos, start_dir = zf.infolist(), zf.start_dir
    except CkptkitError:
        raise
    except (
        zipfile.BadZipFile,
        ValueError,
        OSError,
        EOFError,
        struct.error,
        NotImplementedError,
        OverflowError,
    ) as exc:  # a damaged directory surfaces as any of these (names: UnicodeDecodeError)
        where = f" at offset {offset}" if offset else ""
        detail = str(exc)[:120] or type(exc).__name__
        raise FormatError(
            f"{label}: damaged torch.save archive{where}: its zip directory cannot be read "
            f"(the file may be cut short): {detail}"
        ) from None
    read: Callable[[int, int], bytes] = (
        (lambda at, n: copy[at : at + n])
        if copy is not None
        else _HeaderReads(
            lambda at, n: source.read(rel, offset + at, n),
            infos,
            min(start_dir, length) if offset + length <= source.size(rel) else 0,
        ).read
    )
    members = _members(read, offset, length, label, infos, start_dir)
    pkls = [n for n in members if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise FormatError(f"{label}: torch.save archive must hold exactly one <root>/data.pkl, found {len(pkls)}")
    prefix = archive_folder(list(members), label)  # (torch.load's folder: the first member's, holding them all)
    archive = _with_records(Archive(source, rel, prefix, members, copy=copy, base=offset))
    if memo is not None and plain is not None and copy is not None:
        memo.remember_layout(copy, offset, plain[1], members, prefix)
    return archive


def _with_records(archive: Archive) -> Archive:
    """`archive`, once its byteorder, version and alignment records read as torch.load reads them."""
    check_records(
        archive.label, archive.prefix, archive.members, record_reader(archive.members, archive.prefix, archive.read)
    )
    return archive


_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header (30 bytes)
_DATA_DESCRIPTOR = 0x08  # general purpose flag bit 3: sizes and CRC follow the data
_ENCRYPTED = 0x01
_UTF8 = 0x800  # names are UTF-8 (else code page 437)
_END = struct.Struct("<4sHHHHIIH")  # the end of central directory record (22 bytes)
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # a central directory entry (46 bytes)
_ZIP64_LOCATOR = struct.Struct("<4sIQI")  # the zip64 end record's locator (20 bytes)
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")  # the zip64 end of central directory record (56 bytes)


class _Entry(NamedTuple):
    """The fields of a central directory entry `_members` checks (zipfile.ZipInfo's names; a
    tuple: one per storage record, 20k in a ZeRO-3 model-states file)."""

    filename: str
    orig_filename: str
    flag_bits: int
    compress_type: int
    compress_size: int
    file_size: int
    header_offset: int
    CRC: int


def _plain_directory(copy: bytes) -> tuple[list[_Entry], int] | None:
    """The central directory of a small archive read whole, parsed with struct, when it is the
    plain kind torch.save writes: one disk, no archive comment, no zip64 fields in the entries, no
    bytes before the archive, entries filling the directory exactly, names without NUL (zipfile's
    reading of the end records, zip64 included). Anything else is None, and zipfile reads it with
    its own checks and messages: this is only the fast path for DCP's many small items, where
    zipfile's general parser costs more than the rest of the item."""
    found = _end_records(copy, len(copy))
    if found is None:
        return None
    count, cd_offset, end = found
    entries = _central_entries(copy, cd_offset, end, count, extras_checked=False)
    return (entries, cd_offset) if entries is not None else None


# the most bytes of zip directory _tail_directory reads at once (zipfile reads it whole too)
_TAIL_DIRECTORY = 256 << 20
_TAIL = _END.size + _ZIP64_LOCATOR.size + _ZIP64_END.size  # the end records, zip64's included


def _tail_directory(source: Source, rel: str, offset: int, length: int) -> tuple[list[_Entry], int] | None:
    """_plain_directory for an archive too big to read whole: its end records and central
    directory read from the end in two bounded reads, so the directory is parsed once (by
    struct, not zipfile). Entries with extra fields also go to zipfile, which checks them."""
    size = source.size(rel)
    if offset + length > size:
        return None
    tail_len = min(length, _TAIL)
    found = _end_records(source.read(rel, offset + length - tail_len, tail_len), length)
    if found is None:
        return None
    count, cd_offset, end = found
    if end - cd_offset > _TAIL_DIRECTORY:
        return None
    directory = source.read(rel, offset + cd_offset, end - cd_offset)
    entries = _central_entries(directory, 0, len(directory), count, extras_checked=True)
    return (entries, cd_offset) if entries is not None else None


def _end_records(tail: bytes, n: int) -> tuple[int, int, int] | None:
    """(entry count, directory offset, directory end) from the last bytes `tail` of an `n`-byte
    archive, when its end records are the plain kind (see _plain_directory); else None."""
    base = n - len(tail)  # the archive offset of tail[0]
    if len(tail) < _END.size:
        return None
    magic, disk, cd_disk, _here, count, cd_size, cd_offset, comment = _END.unpack_from(tail, len(tail) - _END.size)
    end = len(tail) - _END.size
    if magic != b"PK\x05\x06" or comment:
        return None
    if end >= _ZIP64_LOCATOR.size and tail[end - _ZIP64_LOCATOR.size : end - _ZIP64_LOCATOR.size + 4] == b"PK\x06\x07":
        located = end - _ZIP64_LOCATOR.size
        _sig, locator_disk, _record, disks = _ZIP64_LOCATOR.unpack_from(tail, located)
        if locator_disk or disks > 1 or located < _ZIP64_END.size:
            return None
        end = located - _ZIP64_END.size
        (sig, _size, _made, _need, disk, cd_disk, _here, count, cd_size, cd_offset) = _ZIP64_END.unpack_from(tail, end)
        if sig != b"PK\x06\x06":
            return None
    end += base
    if disk or cd_disk or cd_offset + cd_size != end:
        return None
    return count, cd_offset, end


def _central_entries(directory: bytes, at: int, end: int, count: int, extras_checked: bool) -> list[_Entry] | None:
    """The `count` entries of the central directory at [at, end) of `directory`, when it is the
    plain kind, or None (see _plain_directory). `extras_checked`: an entry with extra fields is
    left to zipfile too."""
    entries: list[_Entry] = []
    unpack = _CENTRAL.unpack_from
    while at < end:
        if at + _CENTRAL.size > end:
            return None
        (
            sig,
            _made,
            need,
            flags,
            method,
            _time,
            _date,
            crc,
            csize,
            usize,
            name_len,
            extra_len,
            comment_len,
            _disk,
            _internal,
            _external,
            header,
        ) = unpack(directory, at)
        if sig != b"PK\x01\x02" or need > 63 or 0xFFFFFFFF in (csize, usize, header) or (extras_checked and extra_len):
            return None
        name_at = at + _CENTRAL.size
        raw_name = directory[name_at : name_at + name_len]
        at = name_at + name_len + extra_len + comment_len
        if at > end or b"\x00" in raw_name:
            return None
        try:
            name = raw_name.decode("utf-8" if flags & _UTF8 else "cp437")
        except UnicodeDecodeError:
            return None
        entries.append(_new_tuple(_Entry, (name, name, flags, method, csize, usize, header, crc)))
    if at != end or len(entries) != count:
        return None
    return entries


# local headers closer than this are read together by _HeaderReads, in reads of at most _WINDOW
_GAP = 4096
_WINDOW = 1 << 20


class _HeaderReads:
    """The local-header reads of _members for an archive not held in memory: the headers the
    directory lists, when close together (torch.save's many small storages), are read a window
    at a time rather than one request each. Only ranges inside [0, limit) of the archive are
    windowed (`limit`: start_dir, 0 for an archive said to run past its file's end); any other
    read goes through as asked (and fails, or not, as it did)."""

    def __init__(self, read: Callable[[int, int], bytes], infos: list, limit: int) -> None:
        self._read = read
        self._window: tuple[int, int] | None = None  # [start, end) of the archive in _bytes
        self._bytes = b""
        spans = sorted(
            (i.header_offset, i.header_offset + _LOCAL.size + len(i.filename.encode("utf-8", "replace"))) for i in infos
        )
        self._windows: dict[int, tuple[int, int]] = {}  # header offset -> the window holding it
        group: list[int] = []
        lo = hi = 0
        for a, b in spans:
            if a < 0 or b > limit:
                continue
            if group and a - hi <= _GAP and b - lo <= _WINDOW:
                group.append(a)
                hi = max(hi, b)
                continue
            self._close(group, lo, hi)
            group, lo, hi = [a], a, b
        self._close(group, lo, hi)

    def _close(self, group: list[int], lo: int, hi: int) -> None:
        if len(group) > 1:
            for a in group:
                self._windows[a] = (lo, hi)

    def read(self, at: int, n: int) -> bytes:
        window = self._windows.get(at)
        if window is None or at + n > window[1]:
            return self._read(at, n)
        if window != self._window:
            self._bytes = self._read(window[0], window[1] - window[0])
            self._window = window
        start = at - window[0]
        return self._bytes[start : start + n]


def _members(
    read: Callable[[int, int], bytes],
    offset: int,
    length: int,
    label: str,
    infos: list[zipfile.ZipInfo],
    start_dir: int,
) -> dict[str, Member]:
    """The members the central directory lists, each checked before any of its bytes is used:
    stored, sizes that agree (directory, local header), data inside [0, start_dir) of the
    archive, no two members overlapping, no name twice. `read(at, n)` reads the archive's bytes."""
    members: dict[str, Member] = {}
    spans: list[tuple[int, int, str]] = []
    if not 0 <= start_dir <= length:
        raise FormatError(
            f"{label}: the zip directory starts at byte {start_dir}, outside the archive's {length} bytes"
        )
    for info in infos:
        name = info.filename
        what = f"{label}: zip member {name}"
        if name in members:
            raise FormatError(f"{what} is listed twice in the zip directory")
        if info.flag_bits & _ENCRYPTED:
            raise FormatError(f"{what} is encrypted; torch.save never encrypts")
        if info.compress_type != zipfile.ZIP_STORED:
            raise FormatError(
                f"{what} is compressed (zip method {info.compress_type}); torch.save stores members uncompressed"
            )
        if info.compress_size != info.file_size:
            raise FormatError(
                f"{what} is stored, but the zip directory declares {info.compress_size} stored and "
                f"{info.file_size} uncompressed bytes"
            )
        if info.header_offset < 0 or info.file_size < 0:
            raise FormatError(f"{what} has a damaged directory entry")
        raw_name = info.orig_filename.encode("utf-8" if info.flag_bits & _UTF8 else "cp437", errors="replace")
        if info.header_offset + _LOCAL.size + len(raw_name) > start_dir:
            raise FormatError(
                f"{what} starts at byte {info.header_offset}, past the end of the archive's data "
                f"({start_dir} bytes before the zip directory)"
            )
        head = read(info.header_offset, _LOCAL.size + len(raw_name))
        magic, _version, flags, method, _time, _date, crc, csize, usize, name_len, extra_len = _LOCAL.unpack(
            head[: _LOCAL.size]
        )
        if magic != ZIP_MAGIC:
            raise FormatError(f"{what} has a damaged local header")
        if method != info.compress_type or head[_LOCAL.size :] != raw_name or name_len != len(raw_name):
            raise FormatError(f"{what}: its local header disagrees with the zip directory (method or name)")
        if (
            not flags & _DATA_DESCRIPTOR
            and 0xFFFFFFFF not in (csize, usize)
            and (csize, usize, crc) != (info.compress_size, info.file_size, info.CRC)
        ):
            raise FormatError(
                f"{what}: its local header declares {usize} bytes (CRC {crc:08x}), the zip "
                f"directory {info.file_size} (CRC {info.CRC:08x})"
            )
        data_offset = info.header_offset + _LOCAL.size + name_len + extra_len
        if data_offset + info.file_size > start_dir:
            raise FormatError(
                f"{what} runs past the end of the archive's data: {info.file_size} bytes at byte "
                f"{data_offset}, the zip directory starts at byte {start_dir} (truncated file?)"
            )
        spans.append((info.header_offset, data_offset + info.file_size, name))
        members[name] = _new_tuple(Member, (name, offset + data_offset, info.file_size, info.CRC, False))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise FormatError(
                f"{label}: zip members {first} and {second} overlap (a member's bytes would "
                f"be read as another's header or data)"
            )
    return members


def _read_member(archive: Archive, name: str) -> bytes:
    m = archive.members.get(name)
    if m is None:
        raise FormatError(f"{archive.label}: archive has no record {name}")
    if m.compressed:
        raise FormatError(f"{archive.label}: record {name} is compressed; torch.save never compresses")
    return archive.read(m.data_offset, m.size)


# a data.pkl at most this long is remembered by StructureMemo (a small tensor's is ~300 bytes)
_MEMO_PICKLE = 4096
_MEMO_ENTRIES = 4096


class StructureMemo:
    """What the lazy load of each small data.pkl gave, by its bytes: the items of a DCP checkpoint
    of many same-shaped tensors carry the very same data.pkl, and the restricted unpickler would
    otherwise run once per item. A hit still checks every storage the pickle references against
    this archive's own members (the part that differs from archive to archive); a pickle that
    was refused is never remembered. TensorRefs are only read, never changed, so one serves all.

    It also remembers the zip layouts of small archives that passed every check of open_archive
    (layout_of / remember_layout, see _Layout)."""

    def __init__(self) -> None:
        self._seen: dict[bytes, tuple[Any, list[Any]]] = {}
        self._layouts: dict[int, list[_Layout]] = {}
        self._layout_count = 0
        self._where: dict[tuple[int, int], tuple[Any, tuple[str, int, int, tuple | None]]] = {}

    def located(self, ref: Any, storage_bytes: int) -> tuple[str, int, int, tuple | None] | None:
        """tensor_location's outcome for this very TensorRef over a storage of this size."""
        hit = self._where.get((id(ref), storage_bytes))
        return hit[1] if hit is not None and hit[0] is ref else None

    def locate(self, ref: Any, storage_bytes: int, where: tuple[str, int, int, tuple | None]) -> None:
        if len(self._where) < _MEMO_ENTRIES:  # (the ref is held: its id is never another's)
            self._where[(id(ref), storage_bytes)] = (ref, where)

    def layout_of(self, copy: bytes, offset: int) -> tuple[dict[str, Member], str] | None:
        """The members and prefix of the archive `copy` (at `offset` of its file) when it is laid
        out byte for byte like one that passed open_archive's checks; None sends it through them."""
        for layout in self._layouts.get(len(copy), ()):
            found = layout.match(copy, offset)
            if found is not None:
                return found, layout.prefix
        return None

    def remember_layout(
        self, copy: bytes, offset: int, start_dir: int, members: dict[str, Member], prefix: str
    ) -> None:
        """Remember the layout of `copy`, which just passed every check of open_archive through
        _plain_directory and _members (`members` at `offset`)."""
        if self._layout_count >= _MEMO_ENTRIES or len(self._layouts.get(len(copy), ())) >= _LAYOUTS_PER_LENGTH:
            return
        layout = _Layout.of(copy, offset, start_dir, members, prefix)
        if layout is not None:
            self._layouts.setdefault(len(copy), []).append(layout)
            self._layout_count += 1

    def get(self, data: bytes) -> tuple[Any, list[Any]] | None:
        return self._seen.get(data)

    def put(self, data: bytes, value: Any, pids: list[Any]) -> None:
        if len(data) <= _MEMO_PICKLE and len(self._seen) < _MEMO_ENTRIES:
            self._seen[data] = (value, pids)


_LAYOUTS_PER_LENGTH = 4
_DESCRIPTOR = b"PK\x07\x08"
_new_tuple = tuple.__new__  # a Member or IntegrityCheck without NamedTuple's Python-level __new__ (7 per DCP item)


@dataclass(frozen=True)
class _Layout:
    """The zip layout of a small archive that passed every check of open_archive (its directory
    read by _plain_directory, its members by _members): every byte of it but the members' data
    and their CRC32 fields (the skeleton), and the members it yielded.

    Why a match is safe: open_archive's checks read nothing but the bytes of the skeleton (the
    zip magic, the end records, the zip64 locator test at 42 bytes before the end, the central
    directory, the local headers) and the CRC fields, whose values are only copied into the
    members and compared (local header against directory) where the local header carries one.
    An archive of the same length whose skeleton is byte-equal therefore gets from them the very
    same members, at its own offset, with its own CRCs, once that comparison is redone here (a
    mismatch goes through the full checks, which refuse it with their own message). A CRC field
    that overlaps a byte those checks read as something else is never masked (no layout is
    remembered); a data descriptor's CRC is masked only where no check reads it."""

    segments: tuple[tuple[int, int], ...]  # the skeleton's byte ranges
    skeleton: bytes
    members: tuple[tuple[str, int, int], ...]  # name, data at, size (the directory's order)
    central: struct.Struct  # unpacks the directory's CRC of each member, in that order
    local: struct.Struct  # unpacks the local headers' CRCs that are compared with the directory's ...
    compared: tuple[int, ...]  # ... those of these members
    prefix: str

    def match(self, copy: bytes, offset: int) -> dict[str, Member] | None:
        if b"".join([copy[a:b] for a, b in self.segments]) != self.skeleton:
            return None
        crcs = self.central.unpack_from(copy)
        if self.compared and self.local.unpack_from(copy) != tuple(crcs[i] for i in self.compared):
            return None  # the full checks refuse it, with their message
        return {
            name: _new_tuple(Member, (name, offset + at, size, crc, False))
            for (name, at, size), crc in zip(self.members, crcs)
        }

    @staticmethod
    def of(copy: bytes, offset: int, start_dir: int, members: dict[str, Member], prefix: str) -> _Layout | None:
        n = len(copy)
        data: list[tuple[int, int]] = []
        masks: list[tuple[int, int]] = []
        read: list[tuple[int, int]] = [(0, 4), (start_dir, n)]  # what the checks read besides local headers
        descriptors: list[tuple[int, int]] = []
        rows: list[tuple[str, int, int, int, int]] = []
        at = start_dir
        for _ in range(len(members)):  # the directory's entries, as _plain_directory walked them
            if at + _CENTRAL.size > n or copy[at : at + 4] != b"PK\x01\x02":
                return None
            (
                _sig,
                _made,
                _need,
                cd_flags,
                _method,
                _time,
                _date,
                _crc,
                _csize,
                _usize,
                name_len,
                extra_len,
                comment_len,
                _disk,
                _internal,
                _external,
                header,
            ) = _CENTRAL.unpack_from(copy, at)
            raw_name = copy[at + _CENTRAL.size : at + _CENTRAL.size + name_len]
            central_crc = at + 16
            at += _CENTRAL.size + name_len + extra_len + comment_len
            try:
                member = members.get(raw_name.decode("utf-8" if cd_flags & _UTF8 else "cp437"))
            except UnicodeDecodeError:
                return None
            if member is None or header + _LOCAL.size > n or copy[header : header + 4] != ZIP_MAGIC:
                return None
            (_magic, _version, flags, _m, _t, _d, _c, csize, usize, local_name, local_extra) = _LOCAL.unpack_from(
                copy, header
            )
            start = member.data_offset - offset
            if (
                start != header + _LOCAL.size + local_name + local_extra
                or copy[header + _LOCAL.size : header + _LOCAL.size + local_name] != raw_name
            ):
                return None
            local_crc = header + 14
            compared = not flags & _DATA_DESCRIPTOR and 0xFFFFFFFF not in (csize, usize)
            rows.append((member.name, start, member.size, central_crc, local_crc if compared else -1))
            read.append((header, start))
            data.append((start, start + member.size))
            masks += [(local_crc, local_crc + 4), (central_crc, central_crc + 4)]
            if flags & _DATA_DESCRIPTOR:
                end = start + member.size
                descriptors.append((end + 4, end + 8) if copy[end : end + 4] == _DESCRIPTOR else (end, end + 4))
        if len(rows) != len(members) or len({r[0] for r in rows}) != len(rows):
            return None
        tail = (max(0, n - _END.size - _ZIP64_LOCATOR.size), n)
        if any(_overlaps(m, r) for m in masks for r in ((0, 4), tail)):
            return None
        masks += [d for d in descriptors if d[1] <= start_dir and not any(_overlaps(d, r) for r in read + data + masks)]
        cut = sorted([r for r in data + masks if r[0] < r[1]])
        if any(a[1] > b[0] for a, b in zip(cut, cut[1:])):
            return None
        segments, pos = [], 0
        for a, b in cut:
            if a > pos:
                segments.append((pos, a))
            pos = max(pos, b)
        if pos < n:
            segments.append((pos, n))
        skeleton = b"".join([copy[a:b] for a, b in segments])
        if [r[0] for r in rows] != list(members):  # (open_archive keeps the directory's order)
            return None
        locals_ = sorted((r[4], i) for i, r in enumerate(rows) if r[4] >= 0)
        return _Layout(
            tuple(segments),
            skeleton,
            tuple(r[:3] for r in rows),
            _fields_at([r[3] for r in rows]),
            _fields_at([at for at, _ in locals_]),
            tuple(i for _, i in locals_),
            prefix,
        )


def _fields_at(positions: list[int]) -> struct.Struct:
    """A struct unpacking the little-endian 32-bit fields at these increasing byte positions."""
    fmt, pos = "<", 0
    for at in positions:
        fmt += f"{at - pos}xI"
        pos = at + 4
    return struct.Struct(fmt)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class LastStructure:
    """A StructureMemo of one entry, whatever its size: the last data.pkl loaded through it. The
    ranks of a ZeRO-3 checkpoint pickle their model-states files alike (a placeholder tensor per
    parameter, 20k for as many parameters; every rank but the first, often that one too): each is
    then unpickled once, the others checked storage by storage against their own archive, as a
    StructureMemo hit is. Only the last is held, so memory stays at one pickle and its structure."""

    def __init__(self) -> None:
        self._data: bytes | None = None
        self._hit: tuple[Any, list[Any]] | None = None

    def get(self, data: bytes) -> tuple[Any, list[Any]] | None:
        return self._hit if self._data is not None and data == self._data else None

    def put(self, data: bytes, value: Any, pids: list[Any]) -> None:
        self._data, self._hit = data, (value, pids)


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
        _check_whole(archive.label, whole_bytes(value))
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


def tensor_span_elems(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from the first to the last element of a strided view (0 when empty)."""
    return strided_span(tuple(size), tuple(stride))


def is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def tensor_location(
    archive: Archive, ref: TensorRef, what: str, memo: StructureMemo | None = None
) -> tuple[str, Location]:
    """The dtype name and byte location of a lazily described tensor, checked against its storage:
    a view that is malformed (negative offset, ...), reaches past its storage or expands a few
    stored bytes into a huge tensor is refused, so the piece's bytes always lie inside its storage
    member's data (never the zip headers before it or the member after it). `memo`: the outcome
    for the same TensorRef (one a StructureMemo hit shares) over a storage member of the same size.
    An empty view that empty_view() passes needs none of the checks: it is located at once."""
    member = archive.storage_member(ref.storage.key)
    if empty_view(ref):  # no bytes, and a view _located accepts over any storage (a ZeRO-3 module's 20k placeholders)
        known = (dtype_name(ref.dtype), 0, 0, None if is_contiguous(ref.size, ref.stride) else tuple(ref.stride))
    else:
        known = memo.located(ref, member.size) if memo is not None else None
        if known is None:
            known = _located(archive, ref, what, member)
            if memo is not None:
                memo.locate(ref, member.size, known)
    dtype, start, length, stride = known
    return dtype, Location(archive.file, member.data_offset + start, length, stride=stride)


def empty_view(ref: TensorRef) -> bool:
    """True when `ref` has no elements and tensor_location would accept it over any storage of
    its archive (offset 0, sizes and strides non-negative ints of one length, dtypes ckptkit
    holds): a reader that skips empty tensors need not locate it. False sends it through
    tensor_location, which words whatever is wrong."""
    size, stride = ref.size, ref.stride
    return (
        type(ref.storage_offset) is int
        and ref.storage_offset == 0
        and type(size) is tuple
        and type(stride) is tuple
        and len(size) == len(stride)
        and 0 in size
        and all(type(v) is int and v >= 0 for v in size)
        and all(type(v) is int and v >= 0 for v in stride)
        and ref.dtype.name in ITEMSIZE
        and ref.storage.dtype.name in ITEMSIZE
    )


def _located(archive: Archive, ref: TensorRef, what: str, member: Member) -> tuple[str, int, int, tuple | None]:
    """tensor_location's checks: the dtype name, the view's start and length in its storage
    member's data, and its strides (None when contiguous)."""
    item = ref.dtype.itemsize
    storage_bytes = min(member.size, ref.storage.numel * ref.storage.dtype.itemsize)
    problem = view_problem(ref.storage_offset, tuple(ref.size), tuple(ref.stride), item, storage_bytes)
    if problem is not None:
        raise FormatError(f"{archive.label}: tensor {what} of storage {ref.storage.key}: {problem}")
    span = strided_span(tuple(ref.size), tuple(ref.stride))
    start, length = ref.storage_offset * item, span * item
    if not (0 <= start and start + length <= member.size):  # view_problem guarantees it; never read headers
        raise FormatError(f"{archive.label}: tensor {what} lies outside its storage member {member.name}")
    stride = None if is_contiguous(ref.size, ref.stride) else tuple(ref.stride)
    return dtype_name(ref.dtype), start, length, stride


def load_values(archive: Archive, value: Any) -> Any:
    """`value` (a non-tensor value of a lazily loaded archive: a step, a tuple of tensors, ...)
    with its TensorRefs replaced by SmallTensors.

    Each storage is read once per call, only the byte range its views need, and shared by them
    (pass every value of an archive in one call); the views' sizes, summed over every call for
    this archive, may not exceed limits.value_bytes() (2,500 views of one 1 MB storage would
    otherwise become 2.5 GB of copies), nor the bytes read the file's size."""
    refs: list[tuple[TensorRef, str, Location]] = []
    _collect(archive, value, refs, set())
    if not refs:
        return value
    ranges: dict[str, tuple[int, int]] = {}
    for ref, _, loc in refs:
        lo, hi = ranges.get(ref.storage.key, (loc.offset, loc.offset + loc.length))
        ranges[ref.storage.key] = (min(lo, loc.offset), max(hi, loc.offset + loc.length))
    archive.values_built += sum(math.prod(ref.size) * ref.dtype.itemsize for ref, _, _ in refs)
    archive.values_read += sum(hi - lo for lo, hi in ranges.values())
    _check_whole(archive.label, archive.values_built)
    if archive.values_read > max(1 << 20, archive.source.size(archive.file)):
        raise FormatError(
            f"{archive.label}: its values would read {archive.values_read} bytes, more than the "
            f"file holds (the same storage bytes over and over)"
        )
    reads = {key: (lo, archive.read(lo, hi - lo)) for key, (lo, hi) in ranges.items()}
    built: dict[int, SmallTensor] = {}
    for ref, dtype, loc in refs:
        lo, raw = reads[ref.storage.key]
        item = ref.dtype.itemsize
        stride = loc.stride if loc.stride is not None else row_major_strides(tuple(ref.size))
        built[id(ref)] = (
            SmallTensor.from_storage(dtype, raw, (loc.offset - lo) // item, tuple(ref.size), stride)
            if (loc.offset - lo) % item == 0
            else _unaligned(dtype, raw, loc.offset - lo, ref, stride)
        )
    return _replace(value, built)


def _check_whole(label: str, nbytes: int) -> None:
    """Tensors loaded whole from one archive (counted per view: each is copied where it is used,
    re-pickled by convert, ...) must fit the share of the memory budget a value may take."""
    cap = limits.value_bytes()
    if nbytes > cap:
        raise FormatError(
            f"{label}: its values hold tensors loaded whole of {nbytes} bytes in all (every view "
            f"of a shared storage counted), more than a quarter of the memory budget ({cap} bytes); "
            f"raise --memory-budget if this is expected"
        )


def whole_bytes(value: Any) -> int:
    """Bytes of the distinct SmallTensors in a loaded value (each view its own), walking
    containers and stand-ins' state without recursion."""
    total, stack, seen = 0, [value], set()
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes, bytearray, int, float, bool)) or v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, SmallTensor):
            total += v.nbytes
        elif isinstance(v, (dict, list, tuple, set, frozenset)) or hasattr(v, "__dict__"):
            if isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, (list, tuple, set, frozenset)):
                stack.extend(v)
            else:
                stack.extend(vars(v).values())
    return total


def _unaligned(dtype: str, raw: bytes, start: int, ref: TensorRef, stride: tuple[int, ...]) -> SmallTensor:
    """A view whose first byte is not on an element boundary of the shared read (views of one
    storage with different dtypes): its own bytes, sliced once."""
    span = strided_span(tuple(ref.size), tuple(stride)) * ref.dtype.itemsize
    return SmallTensor.from_storage(dtype, raw[start : start + span], 0, tuple(ref.size), stride)


def _collect(archive: Archive, value: Any, out: list, seen: set) -> None:
    """The distinct TensorRefs nested in `value`, located (checked) in the archive."""
    stack = [value]
    while stack:
        v = stack.pop()
        if not isinstance(v, (TensorRef, dict, list, tuple)) or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, TensorRef):
            dtype, loc = tensor_location(archive, v, "nested tensor")
            out.append((v, dtype, loc))
        else:
            stack.extend(reversed(list(v.values() if isinstance(v, dict) else v)))


def _replace(value: Any, built: dict[int, SmallTensor]) -> Any:
    if isinstance(value, TensorRef):
        return built[id(value)]
    if isinstance(value, dict):
        return (
            type(value)((k, _replace(v, built)) for k, v in value.items())
            if type(value) is not dict
            else {k: _replace(v, built) for k, v in value.items()}
        )
    if isinstance(value, list):
        return [_replace(v, built) for v in value]
    if type(value) is tuple:
        return tuple(_replace(v, built) for v in value)
    return value


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
