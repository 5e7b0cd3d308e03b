"""Writing outputs so that a crash never leaves something that looks complete.

An output folder is built in a hidden temporary sibling and renamed into place only after every
file was written and flushed; any failure removes the temporary folder. A lock file next to the
target keeps two runs from writing the same output at once.
"""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from typing import TYPE_CHECKING, BinaryIO, Callable

from ..errors import OutputError

if TYPE_CHECKING:
    from ..runner.distributed import Group


class OutputDir:
    """A folder that appears at `path` complete, or not at all.

    In a distributed job every rank enters it: rank 0 takes the lock and creates the temporary
    folder (which every rank must see: a shared filesystem), every rank writes its own files into
    it, small files (`write_bytes`) come from rank 0 only, and rank 0 commits once every rank
    reported success."""

    def __new__(cls, path: str, overwrite: bool = False, group: "Group | None" = None) -> "OutputDir":
        if cls is OutputDir and "://" in path and not path.startswith("file://"):
            from .remote_output import RemoteOutputDir  # object stores: commit by marker, not rename

            return super().__new__(RemoteOutputDir)
        return super().__new__(cls)

    def __init__(self, path: str, overwrite: bool = False, group: "Group | None" = None) -> None:
        self.path = os.path.abspath(path.removeprefix("file://"))
        self.overwrite = overwrite
        parent = os.path.dirname(self.path) or "."
        name = os.path.basename(self.path)
        self.tmp = os.path.join(parent, f".{name}.ckptkit-tmp-{uuid.uuid4().hex[:8]}")
        self._lock_path = os.path.join(parent, f".{name}.ckptkit-lock")
        self._lock_fd: int | None = None
        from ..runner.distributed import LOCAL

        self.group = group or LOCAL

    def _on_root(self, fn: Callable[[], object]) -> None:
        """Run `fn` on rank 0 (the only rank of a one-process run); every rank hears if it failed."""
        error: BaseException | None = None
        if self.group.is_root:
            try:
                fn()
            except BaseException as exc:  # every rank must hear of it
                error = exc
        self.group.check(error)

    def __enter__(self) -> "OutputDir":
        self._on_root(self._enter)
        if not self.group.distributed:
            return self
        self.tmp = self.group.share(self.tmp)
        seen = os.path.isdir(self.tmp)
        self.group.check(None if seen else OutputError(
            f"{self.path}: rank {self.group.rank} cannot see the output folder rank 0 created; a "
            f"distributed run needs OUT on a filesystem every rank shares"))
        return self

    def _enter(self) -> "OutputDir":
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            raise OutputError(f"{self.path}: parent folder {parent} does not exist")
        if os.path.exists(self.path) and not self.overwrite:
            if not (os.path.isdir(self.path) and not os.listdir(self.path)):
                raise OutputError(f"{self.path}: output already exists (choose another path or pass --overwrite)")
        try:
            self._lock_fd = os.open(self._lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.write(self._lock_fd, str(os.getpid()).encode())
        except FileExistsError:
            if not lock_is_stale(self._lock_path):
                raise OutputError(f"{self.path}: another ckptkit run is writing this output "
                                  f"(lock {self._lock_path}); wait for it or remove the lock") from None
            os.unlink(self._lock_path)
            self._lock_fd = os.open(self._lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.write(self._lock_fd, str(os.getpid()).encode())
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot create output ({exc.strerror})") from None
        self._remove_dead_runs()
        os.makedirs(self.tmp)
        return self

    def _remove_dead_runs(self) -> None:
        """We hold the lock, so any other temp sibling was left by a run that was killed."""
        parent = os.path.dirname(self.path)
        prefix = f".{os.path.basename(self.path)}.ckptkit-tmp-"
        for name in os.listdir(parent):
            if name.startswith(prefix):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)

    def file_path(self, rel: str) -> str:
        full = os.path.join(self.tmp, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        return full

    def open(self, rel: str) -> BinaryIO:
        """A new file; it is flushed to disk when closed, so the fsync of one output file
        overlaps the writing of the others instead of queueing up at commit."""
        full = self.file_path(rel)
        return _SyncedFile(open(full, "wb"))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """A small file, written once (by rank 0 in a distributed job)."""
        if not self.group.is_root:
            return
        with self.open(rel) as f:
            f.write(data)

    def commit(self) -> None:
        for root, _dirs, _files in os.walk(self.tmp):
            _fsync_dir(root)
        if os.path.exists(self.path):
            old = self.path + f".ckptkit-old-{uuid.uuid4().hex[:8]}"
            os.rename(self.path, old)
            os.rename(self.tmp, self.path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.tmp, self.path)
        _fsync_dir(os.path.dirname(self.path))

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.group.distributed:
            self._exit_distributed(exc)
            return
        try:
            if exc_type is None:
                self.commit()
        finally:
            self._cleanup()
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise OutputError(f"{self.path}: no space left on device while writing; nothing was written") from None

    def _exit_distributed(self, exc: BaseException | None) -> None:
        """Every rank reports; rank 0 commits only when all succeeded, then tells the others."""
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            exc = OutputError(f"{self.path}: no space left on device while writing (rank {self.group.rank}); "
                              f"nothing was written")
        try:
            self.group.check(exc)
            self._on_root(self.commit)
        finally:
            if self.group.is_root:
                self._cleanup()

    def _cleanup(self) -> None:
        """Remove the temporary folder (absent after a commit) and release the lock."""
        if os.path.exists(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
            try:
                os.unlink(self._lock_path)
            except OSError:
                pass


def lock_is_stale(path: str) -> bool:
    """Whether the lock file at `path` was left by a process that is gone (or is unreadable)."""
    try:
        pid = int(open(path).read().strip() or "0")
    except (OSError, ValueError):
        return True
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class FinishingFile:
    """An open binary file (a proxy: zipfile and friends see a file) that finishes an output's
    work when closed: `_finish(ok)` runs once, with ok False when its `with` block raised."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __enter__(self) -> "FinishingFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)

    def close(self, ok: bool = True) -> None:
        if not self._f.closed:
            self._finish(ok)

    def _finish(self, ok: bool) -> None:
        raise NotImplementedError


class _SyncedFile(FinishingFile):
    """Fsynced when closed, so one file's fsync overlaps the writing of the others."""

    def _finish(self, ok: bool) -> None:
        try:
            if ok:
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._f.close()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
