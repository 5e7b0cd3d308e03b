"""Zip archives rebuilt member by member, with control over each record (the oracle's torch.save
mutants): a member's local header may name another file, carry other sizes or CRC than the central
directory, be stored or deflated; members may be dropped, doubled, renamed or reordered.

Data is aligned to 64 bytes as torch.save aligns it (an extra field of padding), so an unchanged
archive reads exactly as the original.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

ALIGN = 64


@dataclass(frozen=True)
class Member:
    name: str
    data: bytes
    local_name: str | None = None  # the local header's name, where it differs from the directory's
    crc: int | None = None  # a CRC other than the data's, in both records
    local_size: int | None = None  # a size in the local header other than the data's
    deflate: bool = False


def read_members(path: Path) -> list[Member]:
    with zipfile.ZipFile(path) as z:
        return [Member(i.filename, z.read(i)) for i in z.infolist()]


def build(members: list[Member]) -> bytes:
    out, central = bytearray(), bytearray()
    for m in members:
        body = _deflated(m.data) if m.deflate else m.data
        crc = zlib.crc32(m.data) if m.crc is None else m.crc
        local_name = (m.local_name if m.local_name is not None else m.name).encode()
        method = 8 if m.deflate else 0
        header_len = 30 + len(local_name)
        pad = (-(len(out) + header_len + 4)) % ALIGN
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        offset = len(out)
        size = len(body) if m.local_size is None else m.local_size
        raw = len(m.data) if m.local_size is None else m.local_size
        out += (
            struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, size, raw, len(local_name), len(extra))
            + local_name
            + extra
            + body
        )
        name = m.name.encode()
        central += (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                method,
                0,
                0x21,
                crc,
                len(body),
                len(m.data),
                len(name),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + name
        )
    start = len(out)
    out += central
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), start, 0)
    return bytes(out)


def _deflated(data: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


def write(path: Path, members: list[Member]) -> None:
    path.write_bytes(build(members))


def find(members: list[Member], suffix: str) -> int:
    """The position of the first member whose name ends with `suffix` (after the archive folder)."""
    return next(i for i, m in enumerate(members) if m.name.split("/", 1)[-1] == suffix)


def with_data(members: list[Member], i: int, data: bytes) -> list[Member]:
    out = list(members)
    out[i] = replace(out[i], data=data)
    return out
