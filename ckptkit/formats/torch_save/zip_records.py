"""The bytes zipfile writes for a STORED torch.save archive, assembled directly.

An archive of 20k zero-byte placeholder tensors (a ZeRO-3 model-states file) costs zipfile a
ZipInfo, a writer object, two local headers (one with zeros, one rewritten after the data) and
a seek per member: tens of microseconds each. Here each record is packed once, its CRC and size
known beforehand, and the central directory and end records follow zipfile's own rules (ZIP64
sizes in the local header where zipfile is asked for force_zip64, ZIP64 end records past 65535
members or 4 GiB). `matches_zipfile` checks the bytes against zipfile itself once per process;
the archive writer uses zipfile wherever it does not match.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

__all__ = ["Records", "matches_zipfile"]

_LOCAL = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # zipfile.structCentralDir
_END = struct.Struct("<4s4H2LH")  # zipfile.structEndArchive
_END64 = struct.Struct("<4sQ2H2L4Q")  # zipfile.structEndArchive64
_LOCATOR = struct.Struct("<4sLQL")  # zipfile.structEndArchive64Locator
_ZIP64_EXTRA = struct.Struct("<HHQQ")
_LIMIT = (1 << 31) - 1  # zipfile.ZIP64_LIMIT
_COUNT_LIMIT = (1 << 16) - 1  # zipfile.ZIP_FILECOUNT_LIMIT
_CREATE_SYSTEM = zipfile.ZipInfo().create_system
_PLAIN, _ZIP64 = 20, 45  # zipfile.DEFAULT_VERSION, ZIP64_VERSION
_MODE = 0o600 << 16  # the external attributes zipfile gives a member written through a ZipInfo


class Records:
    """A STORED zip archive written front to back: `add` each member, then `finish`. Names must
    be ASCII; `align`: the member's data starts on a multiple of it (torch's "FB" padding record,
    the sizes in a ZIP64 extra, as zipfile writes a member opened with force_zip64)."""

    def __init__(self, date_time: tuple[int, int, int, int, int, int]) -> None:
        dt = date_time
        self._date = (dt[0] - 1980) << 9 | dt[1] << 5 | dt[2]
        self._time = dt[3] << 11 | dt[4] << 5 | (dt[5] // 2)
        self.parts: list[bytes] = []
        self.pos = 0
        self._central: list[bytes] = []

    def add(self, name: str, data: bytes, align: int = 0) -> None:
        raw = name.encode("ascii")
        n = len(data)
        crc = zlib.crc32(data)
        if align:
            pad = (-(self.pos + 30 + len(raw) + 20 + 4)) % align
            extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad
            local = (
                _LOCAL.pack(
                    b"PK\x03\x04",
                    _ZIP64,
                    0,
                    0,
                    0,
                    self._time,
                    self._date,
                    crc,
                    0xFFFFFFFF,
                    0xFFFFFFFF,
                    len(raw),
                    len(extra) + 20,
                )
                + raw
                + extra
                + _ZIP64_EXTRA.pack(1, 16, n, n)
            )
            version = _ZIP64
        else:
            extra = b""
            local = _LOCAL.pack(b"PK\x03\x04", _PLAIN, 0, 0, 0, self._time, self._date, crc, n, n, len(raw), 0) + raw
            version = _PLAIN
        if n > _LIMIT or self.pos > _LIMIT:  # zipfile's central record would carry ZIP64 fields
            raise OverflowError("member past zipfile's ZIP64 limit")
        self._central.append(
            _CENTRAL.pack(
                b"PK\x01\x02",
                version,
                _CREATE_SYSTEM,
                version,
                0,
                0,
                0,
                self._time,
                self._date,
                crc,
                n,
                n,
                len(raw),
                len(extra),
                0,
                0,
                0,
                _MODE,
                self.pos,
            )
            + raw
            + extra
        )
        self.parts.append(local)
        self.parts.append(data)
        self.pos += len(local) + n

    def finish(self) -> bytes:
        """The whole archive: members, central directory, end records."""
        start = self.pos
        central = b"".join(self._central)
        count, size = len(self._central), len(central)
        tail = [central]
        if count > _COUNT_LIMIT or start > _LIMIT or size > _LIMIT:
            tail.append(_END64.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, start))
            tail.append(_LOCATOR.pack(b"PK\x06\x07", 0, start + size, 1))
            count, size, start = min(count, 0xFFFF), min(size, 0xFFFFFFFF), min(start, 0xFFFFFFFF)
        tail.append(_END.pack(b"PK\x05\x06", 0, 0, count, count, size, start, 0))
        return b"".join(self.parts + tail)


def zipfile_bytes(members: list[tuple[str, bytes, int]], date_time: tuple[int, int, int, int, int, int]) -> bytes:
    """What zipfile writes for `members` (name, data, align), as the archive writer drives it:
    writestr for unaligned members, open(..., force_zip64=True) with the padding record else."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data, align in members:
            if not align:
                zf.writestr(zipfile.ZipInfo(name, date_time), data)
                continue
            info = zipfile.ZipInfo(name, date_time=date_time)
            info.compress_type = zipfile.ZIP_STORED
            pad = (-(buf.tell() + 30 + len(name.encode()) + 20 + 4)) % align
            info.extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad
            with zf.open(info, "w", force_zip64=True) as member:
                member.write(data)
    return buf.getvalue()


def records_bytes(members: list[tuple[str, bytes, int]], date_time: tuple[int, int, int, int, int, int]) -> bytes:
    records = Records(date_time)
    for name, data, align in members:
        records.add(name, data, align)
    return records.finish()


_MATCHES: list[bool] = []


def matches_zipfile(date_time: tuple[int, int, int, int, int, int], align: int) -> bool:
    """Whether Records gives zipfile's bytes on this Python (checked once, on a sample archive
    of plain and aligned members, empty and not)."""
    if not _MATCHES:
        sample = [("archive/data.pkl", b"\x80\x02}q\x00.", 0), ("archive/byteorder", b"little", 0)]
        sample += [(f"archive/data/{i}", bytes(range(i * 7 % 200)), align) for i in range(12)]
        sample.append(("archive/version", b"3\n", 0))
        try:
            _MATCHES.append(records_bytes(sample, date_time) == zipfile_bytes(sample, date_time))
        except Exception:  # noqa: BLE001 - any failure means: use zipfile
            _MATCHES.append(False)
    return _MATCHES[0]
