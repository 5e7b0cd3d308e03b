"""The lock that keeps two runs from writing one output, taken and broken without races.

A lock file `.OUT.ckptkit-lock` holds one JSON line naming its owner (lock_owner.py); its random
token also names the owner's temporary folder, so a sweep knows whose it is. It is written
complete into a pending file `.OUT.ckptkit-lock-TOKEN` first and hard-linked into place, so a
lock is never seen empty or half written; `EEXIST` means someone holds it.

A lock is stale only when its owner is provably gone (lock_owner.owner_state). A lock from
another host or pid namespace, an empty or unreadable one, a folder or a symlink at the lock path
are never taken over; the error says how to remove them.

Taking over a stale lock is race-free: the taker opens the lock file, takes `flock` on that inode,
checks that the path still names the same inode with the same stale content, and renames its own
pending file over it (an atomic replace: the path is never free). Every other taker either fails
to get the `flock` or finds the path naming another inode, and looks again (and sees a live lock).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time
from dataclasses import dataclass

from ..errors import OutputError
from .lock_owner import DEAD, ELSEWHERE, Owner, owner_state, parse_owner

LOCK_SUFFIX = ".ckptkit-lock"
MAX_LOCK_BYTES = 4096
ATTEMPTS = 200  # looks at a lock that others are busy taking over, 10 ms apart
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


def lock_path_for(path: str) -> str:
    """The lock file of output `path`: a hidden sibling."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{LOCK_SUFFIX}")


def pending_path(lock_path: str, token: str) -> str:
    """Where a run writes its lock before linking it into place (the sweep knows the name)."""
    return f"{lock_path}-{token}"


# ---- reading a lock file safely ----------------------------------------------------------------


def _open_lock(path: str, out: str) -> int | None:
    """An fd on the regular file at `path`, None when nothing is there; OutputError for anything
    else (a folder, a symlink, a FIFO, unreadable), saying how to clear it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputError(
                f"{out}: the lock path {path} is a symlink, not a ckptkit lock file; remove it "
                f"if no ckptkit run is writing this output"
            ) from None
        raise OutputError(
            f"{out}: cannot read the lock {path} ({exc.strerror}); if no ckptkit run is writing this output, remove it"
        ) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise OutputError(
            f"{out}: the lock path {path} is {kind}, not a ckptkit lock file; remove it if no "
            f"ckptkit run is writing this output"
        )
    return fd


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, MAX_LOCK_BYTES + 1, 0)


def _same_inode(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _refusal(out: str, path: str, data: bytes) -> OutputError | None:
    """None when the lock in `data` is stale; else the error that refuses to touch it."""
    if len(data) > MAX_LOCK_BYTES:
        why = "it is larger than any lock ckptkit writes"
    else:
        try:
            owner = parse_owner(data)
        except ValueError as exc:
            why = str(exc)
        else:
            state = owner_state(owner)
            if state == DEAD:
                return None
            if state == ELSEWHERE:
                where = (
                    f"host {owner.host}"
                    if owner.host != socket.gethostname()
                    else f"another pid namespace on host {owner.host}"
                )
                return OutputError(
                    f"{out}: a ckptkit run on {where} holds the lock {path} (pid {owner.pid}), and "
                    f"a lock from another machine is never taken over; if that run is gone, "
                    f"remove {path}"
                )
            return OutputError(
                f"{out}: another ckptkit run is writing this output (lock {path}, "
                f"{owner.describe()}); wait for it or remove the lock"
            )
    return OutputError(
        f"{out}: the lock {path} cannot be judged ({why}), so it is not taken over; if no ckptkit "
        f"run is writing this output, remove it"
    )


def lock_is_stale(path: str) -> bool:
    """Whether the lock file at `path` was left by a run that is provably gone (see owner_state).

    Checking and then removing is a race; to remove a stale lock use `remove_stale_lock`."""
    try:
        fd = _open_lock(path, path)
    except OutputError:
        return False
    if fd is None:
        return False
    try:
        return _refusal(path, path, _read_fd(fd)) is None
    finally:
        os.close(fd)


def remove_stale_lock(path: str) -> bool:
    """Remove the lock at `path` if it is stale, race-free against runs taking it over; True when
    this call removed it."""
    try:
        fd = _open_lock(path, path)
    except OutputError:
        return False
    if fd is None:
        return False
    try:
        data = _read_fd(fd)
        if _refusal(path, path, data) is not None or not _flock(fd):
            return False
        if not _same_inode(fd, path) or _read_fd(fd) != data:
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _flock(fd: int, strict: bool = False) -> bool:
    """An exclusive flock on fd without waiting; False when another process holds one (or the
    filesystem cannot lock, unless `strict`: then that OSError is raised)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        if strict:
            raise
        return False


# ---- taking and releasing ----------------------------------------------------------------------


@dataclass
class HeldLock:
    """A lock this process holds; `release` removes it only if the path still names our inode."""

    path: str
    token: str
    ident: tuple[int, int]

    def release(self) -> None:
        try:
            st = os.lstat(self.path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self.ident:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _write_pending(pending: str, data: bytes, out: str) -> tuple[int, int]:
    parent = os.path.dirname(pending)
    try:
        fd = os.open(pending, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OutputError(f"{out}: cannot write in {parent} ({exc.strerror})") from None
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        _unlink_quietly(pending)
        if exc.errno == errno.ENOSPC:
            raise OutputError(f"{out}: no space left on device in {parent}; nothing was written") from None
        raise OutputError(f"{out}: cannot write in {parent} ({exc.strerror})") from None
    os.close(fd)
    return st.st_dev, st.st_ino


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def acquire(lock_path: str, token: str, out: str) -> HeldLock:
    """Take the lock at `lock_path` for output `out` (or take over a stale one); OutputError with
    one sentence when it is held, foreign, unreadable or cannot be written. Leaves no file
    behind when it fails."""
    pending = pending_path(lock_path, token)
    data = Owner.me(token).encode()
    for _ in range(ATTEMPTS):
        ident = _write_pending(pending, data, out)
        try:
            if _link(pending, lock_path, data, out):
                return HeldLock(lock_path, token, _ident_of(lock_path, ident))
            if _take_over(lock_path, pending, out):
                return HeldLock(lock_path, token, ident)
        finally:
            _unlink_quietly(pending)
        time.sleep(0.01)
    raise OutputError(
        f"{out}: the lock {lock_path} kept changing hands while this run tried to take it; "
        f"another ckptkit run is writing this output"
    )


def _ident_of(path: str, fallback: tuple[int, int]) -> tuple[int, int]:
    try:
        st = os.lstat(path)
        return st.st_dev, st.st_ino
    except OSError:
        return fallback


def _link(pending: str, lock_path: str, data: bytes, out: str) -> bool:
    """Put our lock in place if the path is free; False when something is there."""
    try:
        os.link(pending, lock_path, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    except FileNotFoundError:
        return False  # our pending file was swept away by the lock's holder: look again
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise OutputError(f"{out}: cannot create the lock {lock_path} ({exc.strerror})") from None
    # a filesystem without hard links: an exclusive create (a reader may see it empty for an
    # instant, and an empty lock is never stale)
    try:
        fd = os.open(lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        raise OutputError(f"{out}: cannot create the lock {lock_path} ({exc.strerror})") from None
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return True


def _take_over(lock_path: str, pending: str, out: str) -> bool:
    """True when the lock at `lock_path` was stale and our pending file replaced it; False to look
    again (it vanished, or another run is taking it over); OutputError when it is not stale."""
    fd = _open_lock(lock_path, out)
    if fd is None:
        return False
    try:
        data = _read_fd(fd)
        refusal = _refusal(out, lock_path, data)
        if refusal is not None:
            raise refusal
        try:
            if not _flock(fd, strict=True):
                return False
        except OSError as exc:
            raise OutputError(
                f"{out}: the lock {lock_path} was left by a run that is gone, but this filesystem "
                f"cannot lock files ({exc.strerror}) to take it over safely; remove it"
            ) from None
        if not _same_inode(fd, lock_path) or _read_fd(fd) != data:
            return False
        try:
            os.rename(pending, lock_path)  # atomic: the lock path is never free
        except FileNotFoundError:
            return False  # our pending file was swept away: look again
        return True
    finally:
        os.close(fd)
