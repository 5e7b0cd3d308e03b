"""What same-shaped archives share, checked once: `StructureMemo` (the zip layouts of small
archives and the structure of small data.pkl files, a DCP folder's many items) and
`LastStructure` (the last data.pkl loaded, whatever its size: ZeRO ranks that pickle alike).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from .zip_directory import CENTRAL, DATA_DESCRIPTOR, END, LOCAL, UTF8, ZIP64_LOCATOR, ZIP_MAGIC, Member, new_tuple


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
    (layout_of / remember_layout, see ZipLayout)."""

    def __init__(self) -> None:
        self._seen: dict[bytes, tuple[Any, list[Any]]] = {}
        self._layouts: dict[int, list[ZipLayout]] = {}
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
        plain_directory and checked_members (`members` at `offset`)."""
        if self._layout_count >= _MEMO_ENTRIES or len(self._layouts.get(len(copy), ())) >= _LAYOUTS_PER_LENGTH:
            return
        layout = ZipLayout.of(copy, offset, start_dir, members, prefix)
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


@dataclass(frozen=True)
class ZipLayout:
    """The zip layout of a small archive that passed every check of open_archive (its directory
    read by plain_directory, its members by checked_members): every byte of it but the members' data
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
            name: new_tuple(Member, (name, offset + at, size, crc, False))
            for (name, at, size), crc in zip(self.members, crcs)
        }

    @staticmethod
    def of(copy: bytes, offset: int, start_dir: int, members: dict[str, Member], prefix: str) -> ZipLayout | None:
        found = _entry_rows(copy, offset, start_dir, members)
        if found is None:
            return None
        rows, read, data, masks, descriptors = found
        n = len(copy)
        if len(rows) != len(members) or len({r[0] for r in rows}) != len(rows):
            return None
        tail = (max(0, n - END.size - ZIP64_LOCATOR.size), n)
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
        return ZipLayout(
            tuple(segments),
            skeleton,
            tuple(r[:3] for r in rows),
            _fields_at([r[3] for r in rows]),
            _fields_at([at for at, _ in locals_]),
            tuple(i for _, i in locals_),
            prefix,
        )


def _entry_rows(copy: bytes, offset: int, start_dir: int, members: dict[str, Member]) -> tuple | None:
    """The directory's entries of `copy`, walked as plain_directory walked them: a row per member
    (name, data start, size, central CRC field, compared local CRC field or -1), the ranges the
    checks read besides local headers, the members' data, the CRC fields to mask and the data
    descriptors; None when the layout is not one a match can serve."""
    n = len(copy)
    data: list[tuple[int, int]] = []
    masks: list[tuple[int, int]] = []
    read: list[tuple[int, int]] = [(0, 4), (start_dir, n)]  # what the checks read besides local headers
    descriptors: list[tuple[int, int]] = []
    rows: list[tuple[str, int, int, int, int]] = []
    at = start_dir
    for _ in range(len(members)):  # the directory's entries, as plain_directory walked them
        if at + CENTRAL.size > n or copy[at : at + 4] != b"PK\x01\x02":
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
        ) = CENTRAL.unpack_from(copy, at)
        raw_name = copy[at + CENTRAL.size : at + CENTRAL.size + name_len]
        central_crc = at + 16
        at += CENTRAL.size + name_len + extra_len + comment_len
        try:
            member = members.get(raw_name.decode("utf-8" if cd_flags & UTF8 else "cp437"))
        except UnicodeDecodeError:
            return None
        if member is None or header + LOCAL.size > n or copy[header : header + 4] != ZIP_MAGIC:
            return None
        (_magic, _version, flags, _m, _t, _d, _c, csize, usize, local_name, local_extra) = LOCAL.unpack_from(
            copy, header
        )
        start = member.data_offset - offset
        if (
            start != header + LOCAL.size + local_name + local_extra
            or copy[header + LOCAL.size : header + LOCAL.size + local_name] != raw_name
        ):
            return None
        local_crc = header + 14
        compared = not flags & DATA_DESCRIPTOR and 0xFFFFFFFF not in (csize, usize)
        rows.append((member.name, start, member.size, central_crc, local_crc if compared else -1))
        read.append((header, start))
        data.append((start, start + member.size))
        masks += [(local_crc, local_crc + 4), (central_crc, central_crc + 4)]
        if flags & DATA_DESCRIPTOR:
            end = start + member.size
            descriptors.append((end + 4, end + 8) if copy[end : end + 4] == _DESCRIPTOR else (end, end + 4))
    return rows, read, data, masks, descriptors


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
