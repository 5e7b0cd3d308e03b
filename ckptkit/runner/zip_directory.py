"""The zip directory of a torch.save archive: its members, read over exact byte ranges and each
checked before any of its bytes is used, and `Archive`, an archive whose directory passed them.

The plain directory torch.save writes is parsed with struct (a small archive from its copy in
memory, a big one from two bounded reads at its end); anything else goes to the standard library's
zipfile, which checks it with its own messages. Either way `checked_members` then checks every
member: stored, sizes that agree (directory, local header), data inside the archive before its
central directory, no two members overlapping, no name twice.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple

from ..errors import CkptkitError, FormatError
from ..index.types import IntegrityCheck
from ..storage.source import BytesSource, RangeFile, Source

ZIP_MAGIC = b"PK\x03\x04"
new_tuple = tuple.__new__  # a Member or IntegrityCheck without NamedTuple's Python-level __new__ (7 per DCP item)


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
            new_tuple(IntegrityCheck, (self.file, m.data_offset, m.size, m.crc32, f"zip member {m.name}"))
            for m in self.members.values()
            if not m.compressed
        ]


LOCAL = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header (30 bytes)
DATA_DESCRIPTOR = 0x08  # general purpose flag bit 3: sizes and CRC follow the data
_ENCRYPTED = 0x01
UTF8 = 0x800  # names are UTF-8 (else code page 437)
END = struct.Struct("<4sHHHHIIH")  # the end of central directory record (22 bytes)
CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # a central directory entry (46 bytes)
ZIP64_LOCATOR = struct.Struct("<4sIQI")  # the zip64 end record's locator (20 bytes)
ZIP64_END = struct.Struct("<4sQHHIIQQQQ")  # the zip64 end of central directory record (56 bytes)


class ZipEntry(NamedTuple):
    """The fields of a central directory entry `checked_members` checks (zipfile.ZipInfo's names; a
    tuple: one per storage record, 20k in a ZeRO-3 model-states file)."""

    filename: str
    orig_filename: str
    flag_bits: int
    compress_type: int
    compress_size: int
    file_size: int
    header_offset: int
    CRC: int


def plain_directory(copy: bytes) -> tuple[list[ZipEntry], int] | None:
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


def zipfile_directory(
    source: Source, rel: str, offset: int, length: int, copy: bytes | None, label: str
) -> tuple[list[zipfile.ZipInfo], int]:
    """The directory of an archive that is not the plain kind (see plain_directory), read by
    zipfile with its own checks: its entries and where the directory starts. A damaged one is
    one sentence naming the file."""
    try:
        raw = (
            RangeFile(BytesSource(copy, label), "", 0, length)
            if copy is not None
            else RangeFile(source, rel, offset, length)
        )
        zf = zipfile.ZipFile(io.BufferedReader(raw, buffer_size=65536))
        return zf.infolist(), zf.start_dir
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


# the most bytes of zip directory tail_directory reads at once (zipfile reads it whole too)
_TAIL_DIRECTORY = 256 << 20
_TAIL = END.size + ZIP64_LOCATOR.size + ZIP64_END.size  # the end records, zip64's included


def tail_directory(source: Source, rel: str, offset: int, length: int) -> tuple[list[ZipEntry], int] | None:
    """plain_directory for an archive too big to read whole: its end records and central
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
    archive, when its end records are the plain kind (see plain_directory); else None."""
    base = n - len(tail)  # the archive offset of tail[0]
    if len(tail) < END.size:
        return None
    magic, disk, cd_disk, _here, count, cd_size, cd_offset, comment = END.unpack_from(tail, len(tail) - END.size)
    end = len(tail) - END.size
    if magic != b"PK\x05\x06" or comment:
        return None
    if end >= ZIP64_LOCATOR.size and tail[end - ZIP64_LOCATOR.size : end - ZIP64_LOCATOR.size + 4] == b"PK\x06\x07":
        located = end - ZIP64_LOCATOR.size
        _sig, locator_disk, _record, disks = ZIP64_LOCATOR.unpack_from(tail, located)
        if locator_disk or disks > 1 or located < ZIP64_END.size:
            return None
        end = located - ZIP64_END.size
        (sig, _size, _made, _need, disk, cd_disk, _here, count, cd_size, cd_offset) = ZIP64_END.unpack_from(tail, end)
        if sig != b"PK\x06\x06":
            return None
    end += base
    if disk or cd_disk or cd_offset + cd_size != end:
        return None
    return count, cd_offset, end


def _central_entries(directory: bytes, at: int, end: int, count: int, extras_checked: bool) -> list[ZipEntry] | None:
    """The `count` entries of the central directory at [at, end) of `directory`, when it is the
    plain kind, or None (see plain_directory). `extras_checked`: an entry with extra fields is
    left to zipfile too."""
    entries: list[ZipEntry] = []
    unpack = CENTRAL.unpack_from
    while at < end:
        if at + CENTRAL.size > end:
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
        name_at = at + CENTRAL.size
        raw_name = directory[name_at : name_at + name_len]
        at = name_at + name_len + extra_len + comment_len
        if at > end or b"\x00" in raw_name:
            return None
        try:
            name = raw_name.decode("utf-8" if flags & UTF8 else "cp437")
        except UnicodeDecodeError:
            return None
        entries.append(new_tuple(ZipEntry, (name, name, flags, method, csize, usize, header, crc)))
    if at != end or len(entries) != count:
        return None
    return entries


# local headers closer than this are read together by HeaderReads, in reads of at most _WINDOW
_GAP = 4096
_WINDOW = 1 << 20


class HeaderReads:
    """The local-header reads of checked_members for an archive not held in memory: the headers the
    directory lists, when close together (torch.save's many small storages), are read a window
    at a time rather than one request each. Only ranges inside [0, limit) of the archive are
    windowed (`limit`: start_dir, 0 for an archive said to run past its file's end); any other
    read goes through as asked (and fails, or not, as it did)."""

    def __init__(self, read: Callable[[int, int], bytes], infos: list, limit: int) -> None:
        self._read = read
        self._window: tuple[int, int] | None = None  # [start, end) of the archive in _bytes
        self._bytes = b""
        spans = sorted(
            (i.header_offset, i.header_offset + LOCAL.size + len(i.filename.encode("utf-8", "replace"))) for i in infos
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


def checked_members(
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
        raw_name = info.orig_filename.encode("utf-8" if info.flag_bits & UTF8 else "cp437", errors="replace")
        if info.header_offset + LOCAL.size + len(raw_name) > start_dir:
            raise FormatError(
                f"{what} starts at byte {info.header_offset}, past the end of the archive's data "
                f"({start_dir} bytes before the zip directory)"
            )
        head = read(info.header_offset, LOCAL.size + len(raw_name))
        magic, _version, flags, method, _time, _date, crc, csize, usize, name_len, extra_len = LOCAL.unpack(
            head[: LOCAL.size]
        )
        if magic != ZIP_MAGIC:
            raise FormatError(f"{what} has a damaged local header")
        if method != info.compress_type or head[LOCAL.size :] != raw_name or name_len != len(raw_name):
            raise FormatError(f"{what}: its local header disagrees with the zip directory (method or name)")
        if (
            not flags & DATA_DESCRIPTOR
            and 0xFFFFFFFF not in (csize, usize)
            and (csize, usize, crc) != (info.compress_size, info.file_size, info.CRC)
        ):
            raise FormatError(
                f"{what}: its local header declares {usize} bytes (CRC {crc:08x}), the zip "
                f"directory {info.file_size} (CRC {info.CRC:08x})"
            )
        data_offset = info.header_offset + LOCAL.size + name_len + extra_len
        if data_offset + info.file_size > start_dir:
            raise FormatError(
                f"{what} runs past the end of the archive's data: {info.file_size} bytes at byte "
                f"{data_offset}, the zip directory starts at byte {start_dir} (truncated file?)"
            )
        spans.append((info.header_offset, data_offset + info.file_size, name))
        members[name] = new_tuple(Member, (name, offset + data_offset, info.file_size, info.CRC, False))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise FormatError(
                f"{label}: zip members {first} and {second} overlap (a member's bytes would "
                f"be read as another's header or data)"
            )
    return members
