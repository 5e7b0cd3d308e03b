"""Reading a DCP folder's many small items cheaply: what an item's storage record names, looked
up once per distinct value (`ItemFiles`); a data file's next items read ahead in one request
(`ReadWindow`); and item templates (`ItemTemplates`), which serve an item laid out like one that
went through the reader's full path at the cost of one comparison, giving exactly what that path
gives.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any, Iterator

from ...errors import FormatError, quote
from ...index.types import (
    Box,
    CheckTable,
    Encoding,
    IntegrityCheck,
    Location,
    Piece,
    TensorEntry,
    unchecked_location,
    unchecked_piece,
)
from ...runner.archive_records import ident_is_text, ident_name, record_names
from ...runner.structure_memo import ZipLayout
from ...runner.torch_archive import Archive
from ...runner.zip_directory import new_tuple, plain_directory
from ...storage.source import Source


def safe_relpath(path: Any, label: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise FormatError(f"{label}: storage record has a relative_path of type {type(path).__name__}")
    path = str(path)
    norm = posixpath.normpath(path)
    if not path or norm == "." or posixpath.isabs(path) or "\\" in path or ".." in norm.split("/"):
        raise FormatError(f"{label}: storage record points outside the checkpoint folder ({quote(path)})")
    return norm


# the most bytes read ahead for the next items of a file read in order
_READ_AHEAD = 1 << 20


class ItemFiles:
    """What an item's storage record names, looked up once per distinct value rather than once
    per item: the data file's checked relative path, that it is no folder, and its size. Only
    what passed is remembered: a bad path or a missing file is refused by every item naming it."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.label = source.label("")
        self._paths: dict[str, str] = {}
        self._sizes: dict[str, int] = {}

    def relpath(self, path: Any, what: str) -> str:
        rel = self._paths.get(path) if type(path) is str else None
        if rel is None:
            rel = safe_relpath(path, f"{self.label} ({what})")
            if type(path) is str:
                self._paths[path] = rel
        return rel

    def known(self, path: Any) -> tuple[str | None, int | None]:
        """(relative path, size) of the data file `path` names, each where a record naming it
        already passed; else None (nothing is checked or read here)."""
        rel = self._paths.get(path) if type(path) is str else None
        return rel, self._sizes.get(rel) if rel is not None else None

    def size(self, rel: str, what: str) -> int:
        size = self._sizes.get(rel)
        if size is None:
            if self.source.isdir(rel):
                raise FormatError(f"{self.source.label(rel)}: is a folder, but the {what} points at it as a data file")
            size = self._sizes[rel] = self.source.size(rel)
        return size


class ReadWindow:
    """Bytes of one data file read ahead for the next small items: DCP writes a file's items back
    to back, so a run of them costs one read instead of one per item. It reads ahead only while
    the items come in file order (each where the last ended), doubling up to _READ_AHEAD, and
    never past the file's end; items out of order are read alone, as before."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.rel: str | None = None
        self.start = 0
        self.data = b""
        self.ahead = 0
        self.last = -1  # where the last item served ended

    def read(self, rel: str, offset: int, length: int, size: int) -> bytes:
        at = offset - self.start
        if rel == self.rel and 0 <= at and at + length <= len(self.data):
            self.last = offset + length
            return self.data[at : at + length]
        in_order = rel == self.rel and offset == self.last
        self.ahead = min(_READ_AHEAD, max(length, 2 * self.ahead)) if in_order else 0
        self.data = self.source.read(rel, offset, min(size - offset, length + self.ahead))
        self.rel, self.start, self.last = rel, offset, offset + length
        return self.data[:length] if len(self.data) > length else self.data


# item templates: at most this many per (archive length, dtype, shape), and this many bytes in all
# (each holds two ints of its archive's size); kinds of item counted for learning, at most
_TEMPLATES_PER_KIND = 2
_TEMPLATE_BYTES = 16 << 20
_KINDS_COUNTED = 1 << 16


class ItemTemplates:
    """The item templates of one read, by (archive length, dtype, shape): a template is learnt
    from an item that passed the full path, once a second item of its kind goes through it (a
    kind seen once is not worth one), and serves the next items of its kind laid out alike."""

    def __init__(self, files: ItemFiles) -> None:
        self.files = files
        self._kinds: dict[tuple[int, str, tuple[int, ...]], list[ItemTemplate]] = {}
        self._full: dict[tuple[int, str, tuple[int, ...]], int] = {}  # items of each kind read the full way
        self._bytes = 0

    def item(
        self, target: Any, box: Box | None, info: Any, window: ReadWindow
    ) -> tuple[Piece, list[IntegrityCheck]] | None:
        """The item's (piece, checks) when a template serves it, exactly as _read_item would give
        them; None sends it through _read_item (which words any refusal)."""
        if type(target) is not TensorEntry or not self._kinds:
            return None
        fields = getattr(info, "__dict__", None)
        if fields is None:
            return None
        length = fields.get("length")
        templates = self._kinds.get((length, target.dtype, box.sizes)) if type(length) is int else None
        if templates is None:
            return None
        path, offset = fields.get("relative_path"), fields.get("offset")
        transforms = fields.get("transform_descriptors")
        rel, size = self.files.known(path)
        if (
            size is None
            or type(offset) is not int
            or offset < 0
            or offset + length > size
            or not (transforms is None or (type(transforms) in (list, tuple) and not transforms))
        ):
            return None
        copy = window.read(rel, offset, length, size)
        if len(copy) != length:
            return None
        for template in templates:
            got = template.match(copy, offset, rel)
            if got is not None:
                return unchecked_piece(box, got[0]), got[1]  # (checked: see match)
        return None

    def learn(
        self, archive: Archive, dtype: str, size: tuple[int, ...], loc: Location, checks: list[IntegrityCheck]
    ) -> None:
        """Called with what _read_item gave for a small tensor item read whole (`archive.copy`)."""
        copy = archive.copy
        if copy is None:
            return
        kind = (len(copy), dtype, size)
        seen = self._full.get(kind, 0) + 1
        if len(self._full) < _KINDS_COUNTED or kind in self._full:
            self._full[kind] = seen
        known = self._kinds.get(kind, [])
        if seen < 2 or len(known) >= _TEMPLATES_PER_KIND or self._bytes + 2 * len(copy) > _TEMPLATE_BYTES:
            return
        template = ItemTemplate.of(archive, dtype, size, loc, checks)
        if template is not None:
            self._kinds[kind] = known + [template]
            self._bytes += 2 * len(copy)


class ItemTemplate:
    """What a small DCP item holding one tensor gave through _read_item's full path (open_archive,
    load_structure, tensor_location, the dtype and shape check, Archive.checks), kept to serve the
    next items of its kind at the cost of one comparison, one unpack of their CRC32 fields and
    the building of their piece and checks.

    Why a match gives what the full path gives: the comparison covers every byte of the zip layout
    the layout memo compares (ZipLayout's skeleton: all that open_archive's checks read but the
    CRC32 fields, which are unpacked here and, where the local header carries one, compared with
    the directory's as they would be) and every byte of data.pkl. An archive of the same length
    equal on them therefore gets from open_archive the same members (at its own offset, with its
    own CRCs: ZipLayout's argument), from load_structure the same tensor (the same data.pkl, over
    storage members of the same names and sizes), from tensor_location the same view checks and
    the same location relative to the archive, and its dtype and shape are the metadata's (the
    kind is looked up by them). Anything else goes through the full path, which refuses it with
    its own sentence or reads it."""

    __slots__ = (
        "mask",
        "want",
        "central",
        "local",
        "compared",
        "ats",
        "sizes",
        "whats",
        "start",
        "length",
        "stride",
        "ident",
    )

    def __init__(
        self,
        mask: int,
        want: int,
        layout: ZipLayout,
        members: tuple[tuple[int, int, str], ...],
        start: int,
        length: int,
        stride: tuple[int, ...] | None,
        ident: tuple[int, int] | None,
    ) -> None:
        self.ident = ident  # the serialization id's bytes (relative to the archive): each file's own, checked as text
        self.mask, self.want = mask, want  # the bytes compared (as bits of a little-endian int), their values
        self.central, self.local, self.compared = layout.central, layout.local, layout.compared
        # each member's data (relative to the archive), size and check's name, as columns (CheckTable.add_members)
        self.ats, self.sizes, self.whats = (tuple(column) for column in zip(*members)) if members else ((), (), ())
        self.start, self.length, self.stride = start, length, stride  # the tensor's bytes (start relative
        # to the archive) and its element strides: its Location's fields

    @staticmethod
    def of(
        archive: Archive, dtype: str, size: tuple[int, ...], loc: Location, checks: list[IntegrityCheck]
    ) -> ItemTemplate | None:
        """The template of `archive` (read whole), which gave `loc` and `checks`; None when its
        layout is not one the layout memo can remember, or the template would not give them."""
        copy, offset = archive.copy, archive.base
        plain = plain_directory(copy)
        pkl = archive.members.get(f"{archive.prefix}/data.pkl")
        layout = (
            ZipLayout.of(copy, offset, plain[1], archive.members, archive.prefix)
            if plain is not None and pkl is not None
            else None
        )
        if layout is None:
            return None
        mask = bytearray(len(copy))
        at = pkl.data_offset - offset
        records = [
            (m.data_offset - offset, m.data_offset - offset + m.size)  # (what check_records read)
            for m in map(archive.members.get, record_names(archive.prefix))
            if m is not None
        ]
        for a, b in (*layout.segments, (at, at + pkl.size), *records):
            mask[a:b] = b"\xff" * (b - a)
        bits = int.from_bytes(mask, "little")
        members = tuple((m.data_offset - offset, m.size, f"zip member {m.name}") for m in archive.members.values())
        ident = archive.members.get(ident_name(archive.prefix))
        at_ident = (ident.data_offset - offset, ident.size) if ident is not None else None
        template = ItemTemplate(
            bits,
            int.from_bytes(copy, "little") & bits,
            layout,
            members,
            loc.offset - offset,
            loc.length,
            loc.stride,
            at_ident,
        )
        got = template.match(copy, offset, archive.file)  # (one CRC a member: add_members's columns stay aligned)
        if (
            loc.encoding is not Encoding.RAW
            or loc.transforms
            or got is None
            or got[0] != loc
            or len(got[1].crcs) != len(template.ats)
            or list(got[1]) != checks
        ):
            return None  # (never expected: the template gives exactly what the full path gave, or nothing)
        return template

    def match(self, copy: bytes, offset: int, file: str) -> tuple[Location, MatchedChecks] | None:
        """The location and checks of the archive `copy` (at `offset` of `file`) when it is laid
        out like this template's, else None."""
        if int.from_bytes(copy, "little") & self.mask != self.want:
            return None
        if self.ident is not None and not ident_is_text(copy[self.ident[0] : self.ident[0] + self.ident[1]]):
            return None  # the full path refuses it, with its message
        crcs = self.central.unpack_from(copy)
        if self.compared and self.local.unpack_from(copy) != tuple([crcs[i] for i in self.compared]):
            return None  # the full path refuses it, with its message
        loc = unchecked_location(file, offset + self.start, self.length, Encoding.RAW, self.stride)
        return loc, MatchedChecks(self, file, offset, crcs)


class MatchedChecks:
    """The checks of an item a template served, not built: 700k IntegrityChecks of a 100k-item
    checkpoint were made only to be taken apart into the index's CheckTable (issue 17), which
    takes these columns as they are (`add_to`). Iterates as, and equals, the list the full path
    (Archive.checks) gives."""

    __slots__ = ("template", "file", "offset", "crcs")

    def __init__(self, template: ItemTemplate, file: str, offset: int, crcs: tuple[int, ...]) -> None:
        self.template, self.file, self.offset, self.crcs = template, file, offset, crcs

    def add_to(self, table: CheckTable) -> None:
        t = self.template
        table.add_members(self.file, self.offset, t.ats, t.sizes, self.crcs, t.whats)

    def __iter__(self) -> Iterator[IntegrityCheck]:
        file, offset = self.file, self.offset
        return iter(
            [
                new_tuple(IntegrityCheck, (file, offset + at, size, crc, what))
                for at, size, crc, what in zip(self.template.ats, self.template.sizes, self.crcs, self.template.whats)
            ]
        )

    def __len__(self) -> int:
        return len(self.crcs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, MatchedChecks)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
