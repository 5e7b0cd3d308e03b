"""Stream transforms DCP may apply to items (`transform_descriptors`), decoded on read.

A compressed item says nothing trustworthy about how much it inflates to (a 90 KB zstd frame
can hold 3 GB of zeros), so decoding is always bounded: by the bytes the metadata declares for
a tensor item (plus the torch.save archive around them), by a share of the memory budget for a
value loaded whole. More output than that is a FormatError naming the file and the item. An item
larger than what may be held in memory is never materialised: `open_decoded` returns a Source
over its decoded bytes that keeps the head and tail (zip headers, data.pkl, zip directory) and
streams the rest through a restartable decoder, window by window.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from ..errors import FormatError, MissingDependencyError, UnsupportedError
from ..storage.source import BytesSource, RangeFile, Source

SUPPORTED = ("stream.zstd",)
WINDOW = 1 << 20  # decoded bytes produced per step (and compressed bytes read per step)
HEAD = TAIL = 1 << 20  # decoded bytes a streamed item keeps of its start and end
ARCHIVE_SLACK = 1 << 20  # a tensor item's torch.save archive: zip headers, data.pkl, directory
# The largest decoded size a zstd frame can reach per compressed byte: a block decodes to at most
# 128 KiB and costs at least 4 bytes (3-byte block header + 1 RLE byte).
ZSTD_MAX_RATIO = (128 << 10) // 4


def check(transforms: tuple[str, ...], what: str) -> None:
    """Refuse unknown transforms when indexing, before any byte is read."""
    for desc in transforms:
        name, _, version = desc.partition("/")
        if name not in SUPPORTED or version.partition(".")[0] != "1":
            raise UnsupportedError(f"{what}: item transform {desc!r} is not supported (supported: stream.zstd/1)")


def check_declared(transforms: tuple[str, ...], encoded: int, declared: int, what: str) -> None:
    """Refuse, when indexing, a compressed tensor item that declares more bytes than its encoded
    length can possibly decode to (so no plan is ever made for an impossible tensor)."""
    if transforms and declared > (encoded // 4 + 1) * (ZSTD_MAX_RATIO * 4):
        raise FormatError(f"{what}: declares {declared} bytes, more than {encoded} zstd-compressed bytes can hold")


def tensor_limit(declared: int) -> int:
    """The most bytes a tensor item of `declared` data bytes may decode to."""
    return declared + ARCHIVE_SLACK


def decode(data: bytes, transforms: tuple[str, ...], what: str, limit: int | None = None) -> bytes:
    """Undo DCP's save-side transforms, last applied first, producing at most `limit` bytes
    (default: the share of the memory budget a value loaded whole may take)."""
    if limit is None:
        from . import limits

        limit = limits.value_bytes()
    for desc in reversed(transforms):
        name, _, version = desc.partition("/")
        if name == "stream.zstd":
            if version.partition(".")[0] != "1":
                raise UnsupportedError(f"{what}: zstd stream version {version!r} is not supported")
            out = bytearray()
            for chunk in _zstd_chunks(_BytesReader(data), what, limit, _window_limit(limit)):
                out += chunk
            data = bytes(out)
        else:
            raise UnsupportedError(f"{what}: item transform {desc!r} is not supported")
    return data


def open_decoded(
    source: Source, rel: str, offset: int, length: int, transforms: tuple[str, ...], what: str, limit: int, keep: int
) -> Any:
    """The decoded bytes of an encoded item at [offset, offset+length) of `rel`, as a Source
    (rel ""): bytes in memory when they are at most `keep` long, else a StreamedItem. Decoding
    more than `limit` bytes is a FormatError. One pass over the item either way."""
    check(transforms, what)
    if len(transforms) != 1:
        raise UnsupportedError(f"{what}: {len(transforms)} stacked item transforms are not supported")

    def chunks() -> Iterator[bytes]:
        return _zstd_chunks(RangeFile(source, rel, offset, length), what, limit, _window_limit(limit))

    held: list[bytes] = []
    size = 0
    head = tail = b""
    for chunk in chunks():
        size += len(chunk)
        if held is not None:
            held.append(chunk)
            if size <= keep:
                continue
            joined = b"".join(held)  # past `keep`: from now on only the head and a rolling tail
            held = None  # type: ignore[assignment]
            head, tail = joined[:HEAD], joined[-TAIL:]
            continue
        tail = (tail + chunk)[-TAIL:]
    if held is not None:
        return MemoryItem(bytearray().join(held), what)  # writable: torch views it without a copy
    return StreamedItem(what, size, head, tail, chunks)


def _window_limit(limit: int) -> int:
    """The largest zstd window (decoder memory) a frame may ask for: 8 MiB always (torch's
    compression level uses 2 MiB), more only as far as the output limit and a quarter of the
    memory budget go, never past libzstd's own default limit of 128 MiB."""
    from . import limits

    return max(8 << 20, min(limit, limits.budget() // 4, 128 << 20))


class _BytesReader:
    """A file-like reader over bytes (zstandard's stream_reader reads from it)."""

    def __init__(self, data: bytes) -> None:
        self._view, self._pos = memoryview(data), 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n < 0 else min(len(self._view), self._pos + n)
        out = bytes(self._view[self._pos : end])
        self._pos = end
        return out


def _zstd_chunks(raw: Any, what: str, limit: int, max_window: int) -> Iterator[bytes]:
    """Decoded bytes of the zstd frame read from `raw` (a file-like object), WINDOW at a time,
    refusing output beyond `limit`."""
    try:
        import zstandard
    except ImportError:
        zstandard = None
    produced = 0
    if zstandard is not None:
        try:
            reader = zstandard.ZstdDecompressor(max_window_size=max_window).stream_reader(raw, read_size=WINDOW)
            while True:
                chunk = reader.read(min(WINDOW, limit + 1 - produced))
                if not chunk:
                    return
                produced += len(chunk)
                if produced > limit:
                    raise FormatError(_too_much(what, limit))
                yield chunk
        except zstandard.ZstdError as exc:
            raise FormatError(f"{what}: damaged zstd stream ({exc})") from None
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14
    except ImportError:
        raise MissingDependencyError(f"{what} is zstd-compressed; install the 'zstandard' package to read it") from None
    try:
        dec = zstd.ZstdDecompressor(options={zstd.DecompressionParameter.window_log_max: max_window.bit_length()})
        while not dec.eof:
            data = raw.read(WINDOW) if dec.needs_input else b""
            if dec.needs_input and not data:
                return  # a truncated frame: the archive's own checks report it
            chunk = dec.decompress(data, max_length=min(WINDOW, limit + 1 - produced))
            produced += len(chunk)
            if produced > limit:
                raise FormatError(_too_much(what, limit))
            if chunk:
                yield chunk
    except zstd.ZstdError as exc:
        raise FormatError(f"{what}: damaged zstd stream ({exc})") from None


def _too_much(what: str, limit: int) -> str:
    return (
        f"{what}: decompresses to more than the {limit} bytes its metadata allows "
        f"(a decompression bomb or a damaged item)"
    )


class MemoryItem(BytesSource):
    """A decoded item held in memory, as a Source (rel is ignored)."""

    what = "decoded item"


class _Cursor:
    """One decoder positioned in a streamed item: `pending` holds decoded bytes from `pos` on."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.pos, self.pending = chunks, 0, b""


class StreamedItem(MemoryItem):
    """A decoded item too large to hold, as a Source: its first and last bytes are kept, any
    other range is decoded from the start of the frame by one of a few decoders (cursors); a
    read at or after a cursor continues it, so each reader going forward (one per worker thread)
    costs one pass. Thread-safe."""

    CURSORS = 4

    def __init__(self, label: str, size: int, head: bytes, tail: bytes, chunks: Any) -> None:
        self.root, self._size = label, size
        self._head, self._tail = head, tail
        self._chunks = chunks
        self._lock = threading.Lock()
        self._cursors: list[_Cursor] = []
        self.nbytes = len(head) + len(tail) + self.CURSORS * 2 * WINDOW

    def size(self, rel: str) -> int:
        return self._size

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self.read("", offset, length))

    def read(self, rel: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.readinto(rel, offset, memoryview(buf))
        return bytes(buf)

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        length = len(buf)
        if offset < 0 or offset + length > self._size:
            raise FormatError(f"{self.root}: decoded item ends before byte {offset + length}")
        if offset + length <= len(self._head):
            buf[:] = self._head[offset : offset + length]
            return
        tail_start = self._size - len(self._tail)
        if offset >= tail_start:
            buf[:] = self._tail[offset - tail_start : offset - tail_start + length]
            return
        with self._lock:
            self._copy(self._cursor_for(offset), offset, buf)

    def _cursor_for(self, offset: int) -> _Cursor:
        """The cursor furthest along that has not passed `offset`; else a new one (or the one
        furthest behind, restarted)."""
        behind = [c for c in self._cursors if c.pos <= offset]
        if behind:
            return max(behind, key=lambda c: c.pos)
        if len(self._cursors) >= self.CURSORS:
            self._cursors.remove(min(self._cursors, key=lambda c: c.pos))
        cursor = _Cursor(self._chunks())
        self._cursors.append(cursor)
        return cursor

    def _copy(self, cursor: _Cursor, offset: int, buf: memoryview) -> None:
        done, length = 0, len(buf)
        while done < length:
            if not cursor.pending:
                cursor.pending = next(cursor.chunks, b"")
                if not cursor.pending:
                    raise FormatError(f"{self.root}: decoded item ends early (it changed while being read?)")
            pos = offset + done
            end = cursor.pos + len(cursor.pending)
            if pos >= end:  # skip a whole chunk
                cursor.pos, cursor.pending = end, b""
                continue
            start = pos - cursor.pos
            n = min(length - done, len(cursor.pending) - start)
            buf[done : done + n] = cursor.pending[start : start + n]
            done += n
            if start + n == len(cursor.pending):
                cursor.pos, cursor.pending = end, b""

    def close(self) -> None:
        with self._lock:
            self._cursors = []
