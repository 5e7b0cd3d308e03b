"""Which local files a checkpoint read may open, and how to open them without ever blocking.

A checkpoint folder is untrusted input. A data file linked to /etc/passwd (or to another user's
checkpoint) must not be copied into an output, and a FIFO, a device or a socket in place of a file
must not hang the reader. So every path is checked before it is opened:

- it resolves (by real path) inside the checkpoint's real path, or inside the `blobs/` folder of
  the Hugging Face cache repo whose `snapshots/<rev>` the checkpoint is; a link that leaves is
  refused naming the link, unless the user allows it (`--follow-links`, CKPTKIT_FOLLOW_LINKS=1);
- a path the metadata names ("../x", "/etc/x") that leaves the folder by itself is always refused;
- only regular files are opened, with O_NONBLOCK, and the descriptor actually opened is checked
  again (fstat, and its real path through /proc) so a swap between check and open gains nothing.

The checkpoint path itself may be a link (the user chose it): it is resolved once, at open.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from ..errors import FormatError, UnsafePathError, quote

FOLLOW_ENV = "CKPTKIT_FOLLOW_LINKS"
FOLLOW_HINT = "pass --follow-links (or set CKPTKIT_FOLLOW_LINKS=1) to read it anyway"
HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


def follow_links_default(follow: bool | None = None) -> bool:
    """An explicit choice wins; otherwise CKPTKIT_FOLLOW_LINKS=1 (or true/yes) allows links out."""
    if follow is not None:
        return bool(follow)
    return os.environ.get(FOLLOW_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _inside(real: str, folder: str) -> bool:
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def kind_of(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def hf_blobs_of(real_root: str) -> str | None:
    """The `blobs/` folder of the Hugging Face cache repo when `real_root` is (inside) one of its
    `snapshots/<rev>` folders: the hub stores every snapshot file as a link into it."""
    parts = real_root.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(HF_REPO_PREFIXES) and i + 1 < len(parts):
            repo = os.sep.join(parts[:i]) or os.sep
            blobs = os.path.join(repo, "blobs")
            # the repo's own blobs folder, not a link to somewhere else
            if os.path.isdir(blobs) and not os.path.islink(blobs) and os.path.realpath(blobs) == blobs:
                return blobs
            return None
    return None


def nameable(rel: str) -> bool:
    """A name the file system can hold: no NUL, and text the OS encoding takes (a lone surrogate
    read from a JSON or pickle is not; a listed name's undecodable bytes are, as surrogateescape)."""
    if "\0" in rel:
        return False
    if rel.isascii():
        return True
    try:
        os.fsencode(rel)
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class Boundary:
    """Where the files of one local checkpoint may really live."""

    shown: str  # the checkpoint path as the user gave it (for messages)
    real: str  # its real path: a folder, or the one file of a single-file checkpoint
    only: str | None = None  # single-file checkpoint: the one name that may be read
    extra: tuple[str, ...] = ()  # other folders allowed (a Hugging Face repo's blobs/)
    follow: bool = False  # links may leave (still only regular files are opened)

    @classmethod
    def of(cls, path: str, follow: bool | None = None) -> "Boundary":
        """The boundary of the checkpoint at `path` (a folder or a file), resolved once, now."""
        real = os.path.realpath(path)
        only = None if os.path.isdir(real) else os.path.basename(os.path.abspath(path))
        blobs = hf_blobs_of(real if only is None else os.path.dirname(real))
        return cls(os.path.abspath(path), real, only, (blobs,) if blobs else (), follow_links_default(follow))

    def allows(self, real: str) -> bool:
        if self.only is not None:
            return real == self.real
        return _inside(real, self.real) or any(_inside(real, e) for e in self.extra)

    def lexical(self, rel: str) -> str | None:
        """Where `rel` points before links are followed; None when it leaves by itself."""
        if not nameable(rel):  # no file has this name; os calls would raise on it
            return None
        if self.only is not None:
            return self.real if rel in ("", self.only) else None
        if not rel:
            return self.real
        path = os.path.normpath(os.path.join(self.real, rel))
        return None if os.path.isabs(rel) or not _inside(path, self.real) else path

    def resolve(self, rel: str, label: str) -> str:
        """The path to open for `rel` (relative to the checkpoint); refuses one that leaves it."""
        path = self.lexical(rel)
        if path is None and not nameable(rel):
            raise UnsafePathError(f"{label}: the checkpoint names a path no file can have ({quote(rel)}); refused")
        if path is None:
            what = "a single file" if self.only is not None else "its folder"
            raise UnsafePathError(f"{label}: the checkpoint names a path outside {what} ({quote(rel)}); refused")
        if not self.follow and self.only is None:
            real = os.path.realpath(path)
            if not self.allows(real):
                self._refuse_link(rel, real, label)
        return path

    def _refuse_link(self, rel: str, real: str, label: str) -> None:
        link = self._first_link_out(rel) or label
        raise UnsafePathError(
            f"{link}: is a link leading to {quote(real, 200)}, outside the checkpoint "
            f"{self.shown}; refused: {FOLLOW_HINT}"
        )

    def _first_link_out(self, rel: str) -> str | None:
        """The first component of `rel` that is a link leading out (the one to name)."""
        here = self.real
        shown = self.shown
        for part in rel.split("/"):
            if part in ("", "."):
                continue
            here, shown = os.path.join(here, part), os.path.join(shown, part)
            if os.path.islink(here) and not self.allows(os.path.realpath(here)):
                return shown
        return None

    def check_opened(self, fd: int, label: str) -> None:
        """The descriptor really opened is a regular file inside (closing it and refusing if not)."""
        try:
            st = os.fstat(fd)
            kind = kind_of(st.st_mode)
            if kind is not None:
                raise UnsafePathError(f"{label}: is {kind}, not a regular file; refused")
            if not self.follow:
                actual = _fd_path(fd)
                if actual is not None and not self.allows(actual):
                    raise UnsafePathError(
                        f"{label}: resolved to {quote(actual, 200)} when opened, outside "
                        f"the checkpoint {self.shown}; refused: {FOLLOW_HINT}"
                    )
        except BaseException:
            os.close(fd)
            raise


def _fd_path(fd: int) -> str | None:
    """The real path of an open descriptor (Linux /proc), or None where it cannot be known."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if not path.startswith(os.sep) or path.endswith(" (deleted)"):
        return None
    return path


def stat_regular(path: str, label: str) -> os.stat_result:
    """stat() a file that is about to be read: missing, a folder, a FIFO, a device or a socket is
    one sentence. stat never blocks, whatever the file is."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FormatError(f"{label}: cannot read it (file is missing)") from None
    except OSError as exc:
        raise FormatError(f"{label}: cannot read it ({exc.strerror})") from None
    kind = kind_of(st.st_mode)
    if kind == "a folder":
        raise FormatError(f"{label}: is a folder, expected a file")
    if kind is not None:
        raise UnsafePathError(f"{label}: is {kind}, not a regular file; refused")
    return st


def open_regular(path: str, label: str, boundary: Boundary) -> int:
    """A read-only descriptor on the regular file at `path`, opened without blocking and checked
    after opening (type and real path)."""
    stat_regular(path, label)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket (or a device with nothing behind it)
            raise UnsafePathError(f"{label}: is a socket or a device, not a regular file; refused") from None
        raise FormatError(f"{label}: cannot open ({exc.strerror})") from None
    boundary.check_opened(fd, label)
    return fd


def check_folder(path: str, label: str) -> None:
    """A folder about to be listed: it must be one (not a FIFO or a file)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FormatError(f"{label}: folder is missing") from None
    except OSError as exc:
        raise FormatError(f"{label}: cannot list it ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise FormatError(f"{label}: is {kind_of(st.st_mode) or 'a file'}, expected a folder")


def read_small_file(path: str, label: str, limit: int) -> bytes:
    """At most `limit` + 1 bytes of a file the user named by an option (a config, not part of any
    checkpoint): a FIFO, device or socket there is refused instead of blocking or reading forever."""
    stat_regular(path, label)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise UnsafePathError(f"{label}: is a socket or a device, not a regular file; refused") from None
        raise FormatError(f"{label}: cannot open ({exc.strerror})") from None
    try:
        kind = kind_of(os.fstat(fd).st_mode)
        if kind is not None:
            raise UnsafePathError(f"{label}: is {kind}, not a regular file; refused")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, limit + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise FormatError(f"{label}: cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)
