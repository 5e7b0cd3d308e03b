"""A torch.save archive rewritten: its members repacked by Python's zipfile, or its zip records
damaged in one way each (a comment, bytes before it, two disks, a cut tail, a broken directory)."""

from __future__ import annotations

import io
import struct
import zipfile


def repacked(data: bytes) -> bytes:
    """The same members written by Python's zipfile: local headers carrying their CRCs (no data
    descriptors), so the local header's CRC is compared with the directory's."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for info in src.infolist():
            zf.writestr(info.filename, src.read(info))
    return out.getvalue()


def _end(data: bytes) -> int:
    return data.rindex(b"PK\x05\x06")


def with_comment(data: bytes) -> bytes:
    end = _end(data)
    return data[: end + 20] + struct.pack("<H", 3) + b"abc"


def prefixed(data: bytes) -> bytes:
    return b"\0" * 16 + data  # bytes before the archive (zipfile's "concat")


def two_disks(data: bytes) -> bytes:
    locator = data.rindex(b"PK\x06\x07")
    return data[: locator + 16] + struct.pack("<I", 2) + data[locator + 20 :]


def cut(data: bytes) -> bytes:
    return data[:-5]


def central_damaged(data: bytes) -> bytes:
    at = data.index(b"PK\x01\x02")
    return data[:at] + b"XX\x01\x02" + data[at + 4 :]
