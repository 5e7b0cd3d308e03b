"""The records of a torch.save archive that decide how torch.load reads it, read as torch reads
them or refused.

torch.load does more with an archive than unpickle data.pkl over its storages: its zip reader
takes the archive's folder from the first member the zip directory lists and refuses a member
outside it, refuses a file whose `version` record (`.data/version` first) is no number it
supports, byte-swaps every storage when the `byteorder` record says `big` (and refuses any other
word but `little`), refuses a `.storage_alignment` that is no integer and a
`.data/serialization_id` that is no UTF-8 text, and builds the first
storage a key names, handing it to every later persistent id of that key whatever storage type
or size they give. ckptkit reads storages as their little-endian bytes and gives each persistent
id its own type, so each of these records is checked here: what torch would read differently
is refused, never guessed.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from ..errors import FormatError, name_of, quote

# the file format versions torch 2.13's zip reader accepts (kMinSupportedFileFormatVersion to
# kMaxSupportedFileFormatVersion, caffe2/serialize/versions.h)
SUPPORTED_VERSIONS = range(1, 11)
# the most bytes of a record read to check it (torch.save writes a few)
_RECORD_BYTES = 4096
# std::stoull's reading of a version: leading white space, an optional '+', digits (the rest ignored)
_STOULL = re.compile(rb"[ \t\n\v\f\r]*\+?([0-9]+)")


def archive_folder(names: list[str], label: str) -> str:
    """The folder every member must lie in: the first listed member's, as torch's zip reader takes it."""
    if not names:
        raise FormatError(f"{label}: the torch.save archive holds no members")
    first = names[0]
    if "/" not in first:
        raise FormatError(
            f"{label}: zip member {quote(first)} is listed first but lies in no folder; "
            f"torch.load takes the archive's folder from the first member and refuses this file"
        )
    folder = first.split("/", 1)[0]
    for name in names:
        if not name.startswith(folder + "/"):
            raise FormatError(
                f"{label}: zip member {quote(name)} lies outside the archive's folder "
                f"{quote(folder)} (the first member's); torch.load refuses such a file"
            )
    return folder


def record_names(prefix: str) -> tuple[str, ...]:
    """The members whose content check_records reads (a template that skips the checks must compare them)."""
    return (f"{prefix}/byteorder", f"{prefix}/.data/version", f"{prefix}/version", f"{prefix}/.storage_alignment")


def ident_name(prefix: str) -> str:
    """The serialization id's member: different in every file torch.save writes, so a template
    cannot compare it; it checks it is text (check_ident) instead."""
    return f"{prefix}/.data/serialization_id"


def ident_is_text(raw: bytes) -> bool:
    """Whether a serialization id record is what torch.load reads: UTF-8 text."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def record_reader(
    members: Mapping[str, Any], prefix: str, read_span: Callable[[int, int], bytes], gap: int = _RECORD_BYTES
) -> Callable[[Any], bytes]:
    """`read(member)` for check_records that reads the small records lying near each other in one
    span (torch.save puts two of them before the storages and two after): a few reads of a big
    archive, not one per record. A record too large to check is read (and refused) on its own."""
    names = (*record_names(prefix), ident_name(prefix))
    small = sorted(
        (
            m
            for m in map(members.get, names)
            if m is not None and not getattr(m, "compressed", False) and 0 <= m.size <= _RECORD_BYTES
        ),
        key=lambda m: m.data_offset,
    )
    spans: list[list[Any]] = []
    for m in small:
        if spans and m.data_offset - (spans[-1][-1].data_offset + spans[-1][-1].size) <= gap:
            spans[-1].append(m)
        else:
            spans.append([m])
    got: dict[str, bytes] = {}
    for span in spans:
        start, end = span[0].data_offset, max(m.data_offset + m.size for m in span)
        raw = read_span(start, end - start)
        for m in span:
            got[m.name] = raw[m.data_offset - start : m.data_offset - start + m.size]
    return lambda member: got[member.name] if member.name in got else read_span(member.data_offset, member.size)


def check_records(label: str, prefix: str, members: Mapping[str, Any], read: Callable[[Any], bytes]) -> None:
    """Refuse an archive whose records make torch.load refuse it or read its bytes otherwise than
    ckptkit does. `read(member)` gives a member's bytes."""
    byteorder, data_version, version, alignment = (members.get(n) for n in record_names(prefix))
    ident = members.get(ident_name(prefix))
    if byteorder is not None:
        word = _record(byteorder, label, read)
        if word == b"big":
            raise FormatError(
                f"{label}: its byteorder record says 'big': torch.load byte-swaps every storage of "
                f"such a file and ckptkit reads little-endian storages only; re-save it with "
                f"torch.save on a little-endian machine"
            )
        if word != b"little":
            raise FormatError(
                f"{label}: its byteorder record says {quote(word, 40)}, neither "
                f"'little' nor 'big'; torch.load refuses such a file"
            )
    _check_version(label, data_version if data_version is not None else version, read)
    if alignment is not None:
        try:
            int(_record(alignment, label, read))
        except ValueError:
            raise FormatError(
                f"{label}: its .storage_alignment record is no integer; torch.load refuses such a file"
            ) from None
    if ident is not None and not ident_is_text(_record(ident, label, read)):
        raise FormatError(
            f"{label}: its .data/serialization_id record is no UTF-8 text; torch.load refuses such a file"
        )


def _check_version(label: str, member: Any, read: Callable[[Any], bytes]) -> None:
    if member is None:
        raise FormatError(f"{label}: the torch.save archive has no version record; torch.load refuses such a file")
    text = _record(member, label, read)
    found = _STOULL.match(text)
    number = int(found.group(1)) if found is not None and len(found.group(1)) <= 20 else None
    if number not in SUPPORTED_VERSIONS:
        shown = quote(text.strip(), 40)
        raise FormatError(
            f"{label}: its version record says {shown}, not a file format version torch.load reads "
            f"({SUPPORTED_VERSIONS.start} to {SUPPORTED_VERSIONS.stop - 1})"
        )


def _record(member: Any, label: str, read: Callable[[Any], bytes]) -> bytes:
    if getattr(member, "compressed", False):
        raise FormatError(f"{label}: its record {member.name} is compressed; torch.save never compresses one")
    if member.size > _RECORD_BYTES:
        raise FormatError(
            f"{label}: its record {member.name} is {member.size} bytes, more than such a record "
            f"holds ({_RECORD_BYTES} at most)"
        )
    return read(member)


class StorageKinds:
    """The storage type and size the first persistent id of each key gave, as torch.load caches
    the storage it built (an empty one is not cached): a later id of the key naming another type
    or size would be read by torch as the first, so it is refused."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._first: dict[str, tuple[Any, int]] = {}

    def check(self, key: str, dtype: Any, numel: int) -> None:
        first = self._first.get(key)
        if first is None:
            if numel * dtype.itemsize > 0:
                self._first[key] = (dtype, numel)
            return
        if first != (dtype, numel):
            raise FormatError(
                f"{self.label}: storage {name_of(key, 40)} is named by two persistent ids, as "
                f"{first[1]} x {first[0].name} and as {numel} x {dtype.name}; torch.load builds the "
                f"first and reads every later one as it, so the file's values are ambiguous"
            )
