"""Read-only access to a checkpoint's files by exact byte range.

Local paths use positional reads on cached descriptors (thread-safe, no seeking, reads straight
into preallocated buffers); URLs go through fsspec's range reads. Nothing here ever writes.
"""

from __future__ import annotations

import io
import os
import threading
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..errors import QUOTE_LIMIT, CkptkitError, FormatError, NotACheckpointError, StorageError, UsageError
from .paths import Boundary, check_folder, open_regular, stat_regular
from .url_fs import backend_errors, backend_message, failure_behind, filesystem

FILE_URL = "file://"


def path_text(value: object, what: str) -> str:
    """`value` as the path string the training API works with: a str or any os.PathLike
    (pathlib.Path); anything else, or an empty path, is a UsageError naming `what` takes a path."""
    try:
        text = os.fspath(value)  # type: ignore[arg-type]
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise UsageError(f"{what} takes a checkpoint path (a str or pathlib.Path), not {value!r:.80}")
    return text


def is_url(path: str) -> bool:
    """Whether `path` is read through fsspec: any URL but file://, which names a local path."""
    return "://" in path and not path.startswith(FILE_URL)


def local_path(path: str) -> str:
    """A file:// URL as the local path it names (file:///abs/x.pt: /abs/x.pt); any other path as is."""
    return path[len(FILE_URL) :] if path.startswith(FILE_URL) else path


class Source(Protocol):
    root: str

    def size(self, rel: str) -> int: ...
    def exists(self, rel: str) -> bool: ...
    def isdir(self, rel: str = "") -> bool: ...
    def listdir(self, rel: str = "") -> list[str]: ...
    def read(self, rel: str, offset: int, length: int) -> bytes: ...
    def readinto(self, rel: str, offset: int, buf: memoryview) -> None: ...
    def label(self, rel: str) -> str: ...


def shown_rel(rel: str) -> str:
    """`rel` as a message shows it: the metadata names it, so a crafted 5,000-character name is cut
    to QUOTE_LIMIT characters (no message quotes more of a file's content than that)."""
    return rel if len(rel) <= QUOTE_LIMIT else rel[:QUOTE_LIMIT] + "..."


class LocalSource:
    """A local folder or file, read with os.pread / os.preadv.

    Every path is checked by a storage.paths.Boundary fixed at construction: only regular files
    that really lie inside the checkpoint (or that a Hugging Face snapshot links into its blobs)
    are opened, without blocking; `follow_links` lets links leave (still regular files only)."""

    def __init__(self, root: str, follow_links: bool | None = None, only: str | None = None) -> None:
        self.root = os.path.abspath(local_path(root))
        self.boundary = Boundary.of(os.path.join(self.root, only) if only else self.root, follow_links)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}

    def _path(self, rel: str) -> str:  # for messages only: files are opened through the boundary
        return os.path.join(self.root, shown_rel(rel)) if rel else self.root

    def label(self, rel: str) -> str:
        return self._path(rel)

    def exists(self, rel: str) -> bool:
        path = self.boundary.lexical(rel)
        return path is not None and os.path.exists(path)

    def isdir(self, rel: str = "") -> bool:
        path = self.boundary.lexical(rel)
        return path is not None and os.path.isdir(path)

    def listdir(self, rel: str = "") -> list[str]:
        path = self.boundary.resolve(rel, self._path(rel))
        check_folder(path, self._path(rel))
        try:
            return sorted(os.listdir(path))
        except OSError as exc:
            raise FormatError(f"{self._path(rel)}: cannot list it ({exc.strerror})") from None

    def size(self, rel: str) -> int:
        if rel not in self._sizes:
            label = self._path(rel)
            self._sizes[rel] = stat_regular(self.boundary.resolve(rel, label), label).st_size
        return self._sizes[rel]

    def _fd(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is None:
            with self._lock:
                fd = self._fds.get(rel)
                if fd is None:
                    label = self._path(rel)
                    fd = open_regular(self.boundary.resolve(rel, label), label, self.boundary)
                    self._fds[rel] = fd
        return fd

    def read(self, rel: str, offset: int, length: int) -> bytes:
        # one positional read straight into the bytes returned (a DCP folder of 1M items reads
        # 2 GB a megabyte at a time: a buffer, then a copy of it, cost a tenth of inspect)
        if offset < 0 or length <= 0:
            buf = bytearray(length)
            self.readinto(rel, offset, memoryview(buf))
            return bytes(buf)
        data = os.pread(self._fd(rel), length, offset)
        if len(data) == length:
            return data
        buf = bytearray(length)  # a short read: the rest as readinto reads it (and refuses a file cut short)
        buf[: len(data)] = data
        self.readinto(rel, offset + len(data), memoryview(buf)[len(data) :])
        return bytes(buf)

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        if offset < 0:
            raise FormatError(
                f"{self._path(rel)}: asked for bytes at offset {offset}: the metadata that points there is damaged"
            )
        fd = self._fd(rel)
        want = len(buf)
        done = 0
        while done < want:
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise FormatError(
                    f"{self._path(rel)}: file ends at byte {offset + done}, "
                    f"expected {want - done} more bytes (truncated?)"
                )
            done += n

    def fileno(self, rel: str) -> int:
        """An open read-only descriptor (for os.copy_file_range); owned by this source."""
        return self._fd(rel)

    def opened_path(self, rel: str) -> str:
        """A path naming the very file this source opened and checked (for libraries that open by
        path, e.g. safetensors): /proc/self/fd/N where Linux offers it."""
        fd = self._fd(rel)
        proc = f"/proc/self/fd/{fd}"
        return proc if os.path.exists(proc) else self.boundary.resolve(rel, self._path(rel))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class FsspecSource:
    """Any fsspec URL (s3://, gs://, memory://): byte-range reads, never whole-file downloads.

    Whatever the backend raises (credentials, network, permissions) is one sentence naming the
    URL and the backend's message (storage/url_fs.py)."""

    def __init__(self, root: str, fs: object | None = None, base: str | None = None) -> None:
        self.root = root.rstrip("/")
        if fs is None or base is None:
            fs, base = filesystem(self.root, StorageError)
        self.fs: Any = fs
        self._base = base
        self._sizes: dict[str, int] = {}

    def _path(self, rel: str) -> str:
        return f"{self._base}/{rel}" if rel else self._base

    def label(self, rel: str) -> str:
        return f"{self.root}/{shown_rel(rel)}" if rel else self.root

    def _calling(
        self, rel: str, doing: str, missing: str | None = None, error: type[CkptkitError] = FormatError
    ) -> AbstractContextManager[None]:
        """Around one call into the backend: its errors as one sentence naming the file."""
        return backend_errors(self.label(rel), doing, error, missing)

    def exists(self, rel: str) -> bool:
        with self._calling(rel, "looking it up"):
            return bool(self.fs.exists(self._path(rel)))

    def isdir(self, rel: str = "") -> bool:
        with self._calling(rel, "looking it up"):
            return bool(self.fs.isdir(self._path(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        with self._calling(rel, "listing it", "cannot list it (no such folder)"):
            names = self.fs.ls(self._path(rel), detail=False)
        return sorted(os.path.basename(p.rstrip("/")) for p in names)

    def check_there(self) -> None:
        """NotACheckpointError "no such file or folder" unless the root exists; StorageError when
        the backend fails (no credentials) or says what kept the root from being reached."""
        with self._calling("", "opening it", error=StorageError):
            if self.fs.exists(self._base):
                return
            try:  # exists() swallows every error; info() says why (HTTP: FileNotFoundError from the cause)
                self.fs.info(self._base)
                return
            except FileNotFoundError as exc:
                cause = failure_behind(exc)
        if cause is None:
            raise NotACheckpointError(f"{self.root}: no such file or folder")
        what = "the connection failed" if isinstance(cause, OSError) else "the storage refused it"
        raise StorageError(f"{self.root}: cannot reach it: {what} ({backend_message(cause)})")

    def size(self, rel: str) -> int:
        if rel not in self._sizes:
            with self._calling(rel, "reading its size", "file is missing"):
                self._sizes[rel] = int(self.fs.size(self._path(rel)))
        return self._sizes[rel]

    def read(self, rel: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise FormatError(
                f"{self.label(rel)}: asked for {length} bytes at offset {offset}: the metadata "
                f"that points there is damaged"
            )
        with self._calling(rel, "reading it", "cannot read it (file is missing)"):
            data = self.fs.cat_file(self._path(rel), start=offset, end=offset + length)
        if len(data) != length:
            raise FormatError(f"{self.label(rel)}: file ends before byte {offset + length} (truncated?)")
        return data

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        buf[:] = self.read(rel, offset, len(buf))


class BytesSource:
    """A Source over bytes in memory (`rel` is ignored): an archive read whole, a decoded item.
    `what` names the bytes in the error for a read past their end."""

    what = "data"

    def __init__(self, data: bytes | bytearray, label: str) -> None:
        self.root, self.data = label, data
        self._view = memoryview(data)
        self.nbytes = len(data)

    def label(self, rel: str) -> str:
        return self.root

    def size(self, rel: str) -> int:
        return len(self._view)

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > len(self._view):
            raise FormatError(f"{self.root}: {self.what} ends before byte {offset + length}")
        return self._view[offset : offset + length]

    def read(self, rel: str, offset: int, length: int) -> bytes:
        return bytes(self.view(offset, length))

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        buf[:] = self.view(offset, len(buf))

    def exists(self, rel: str) -> bool:
        return True

    def isdir(self, rel: str = "") -> bool:
        return False

    def listdir(self, rel: str = "") -> list[str]:
        return []


def open_source(path: str, follow_links: bool | None = None, only: str | None = None) -> "LocalSource | FsspecSource":
    """Open a checkpoint location read-only; a missing path is a clear error.

    Local sources keep reads inside the checkpoint (see storage.paths): `follow_links` allows links
    that leave it (default: CKPTKIT_FOLLOW_LINKS); `only` names the one file of a single-file
    checkpoint in folder `path`, the only file that may then be read. Remote URLs have no links;
    a URL of the local filesystem (local://) is read as the local path it names, with these checks.
    A URL fsspec cannot open (unknown protocol, package missing, no credentials) is one sentence."""
    if is_url(path):
        fs, base = filesystem(path, StorageError)
        if _is_local(fs):
            return open_source(base, follow_links, only)
        src = FsspecSource(path, fs, base)
        src.check_there()
        return src
    local = LocalSource(path, follow_links, only)
    if not os.path.exists(local.boundary.real):
        raise NotACheckpointError(f"{path}: no such file or folder")
    return local


def _is_local(fs: object) -> bool:
    """Whether fsspec maps a URL to the local filesystem (local://...): read with local checks."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


class RangeFile(io.RawIOBase):
    """A seekable read-only file object over [offset, offset+length) of a source file.

    Lets the standard library's zipfile parse a torch.save archive embedded in a larger file
    (a DCP item) while every read stays an exact byte-range read.
    """

    def __init__(self, source: Source, rel: str, offset: int, length: int) -> None:
        super().__init__()
        self._src, self._rel, self._base, self._len = source, rel, offset, length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            self._pos = pos
        elif whence == 1:
            self._pos += pos
        else:
            self._pos = self._len + pos
        if self._pos < 0:
            raise OSError("negative seek position")
        return self._pos

    def readinto(self, b) -> int:  # type: ignore[override]
        n = max(0, min(len(b), self._len - self._pos))
        if n:
            self._src.readinto(self._rel, self._base + self._pos, memoryview(b)[:n])
            self._pos += n
        return n
