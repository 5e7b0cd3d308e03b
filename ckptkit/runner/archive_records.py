"""The records torch's zip reader checks before it reads any tensor, checked the same way.

torch's PyTorchStreamReader refuses an archive with a member outside its one top folder, and one
whose version record is missing, no number, or outside the zip format versions it reads (1 to 10);
torch.load refuses a `.storage_alignment` record that is no number and a `.data/serialization_id`
that is no UTF-8 text. ckptkit read such archives on
as if the records were right: a future or damaged layout would be read as today's.
"""
from __future__ import annotations

import re
from typing import Any, Protocol, TypeVar

from ..errors import FormatError, quote


class _Archive(Protocol):  # torch_archive.Archive, which imports this module
    prefix: str
    members: dict[str, Any]
    label: str

    def read(self, offset: int, length: int) -> bytes: ...


A = TypeVar("A", bound=_Archive)

MIN_FORMAT_VERSION, MAX_FORMAT_VERSION = 1, 10  # caffe2/serialize/versions.h, the versions torch reads
_NUMBER = re.compile(rb"\s*\d{1,19}\s*")  # what torch parses as a number (surrounding whitespace allowed)


def check_records(archive: A) -> A:
    """`archive`, once its members lie in its folder and its version and alignment records are
    numbers torch reads; anything else is a FormatError naming the file and the record."""
    folder = archive.prefix + "/"
    for name in archive.members:
        if not name.startswith(folder):
            raise FormatError(f"{archive.label}: zip member {quote(name)} lies outside the archive's folder "
                              f"{quote(folder)}; torch.load refuses such an archive")
    version = archive.members.get(f"{folder}.data/version") or archive.members.get(f"{folder}version")
    if version is None:
        raise FormatError(f"{archive.label}: the archive has no version record ({folder}version); "
                          f"torch.load refuses it")
    raw = _content(archive, version)
    if not _NUMBER.fullmatch(raw) or not MIN_FORMAT_VERSION <= int(raw) <= MAX_FORMAT_VERSION:
        raise FormatError(f"{archive.label}: version record {quote(raw.decode('latin-1'))} is not a zip format "
                          f"version torch reads ({MIN_FORMAT_VERSION} to {MAX_FORMAT_VERSION})")
    alignment = archive.members.get(f"{folder}.storage_alignment")
    if alignment is not None and not _NUMBER.fullmatch(_content(archive, alignment)):
        raise FormatError(f"{archive.label}: record {alignment.name} is not a number; torch.load refuses it")
    ident = archive.members.get(f"{folder}.data/serialization_id")
    if ident is not None:
        try:
            _content(archive, ident, 4096).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{archive.label}: record {ident.name} is not UTF-8 text; torch.load refuses it") from None
    return archive


def _content(archive: _Archive, member: Any, limit: int = 64) -> bytes:
    if member.compressed:
        raise FormatError(f"{archive.label}: record {member.name} is compressed; torch.save never compresses")
    if member.size > limit:
        raise FormatError(f"{archive.label}: record {member.name} is {member.size} bytes, more than such a "
                          f"record holds ({limit})")
    return archive.read(member.data_offset, member.size)
