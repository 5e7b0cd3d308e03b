"""Local outputs, committed by an atomic rename (the `RenameOutput` side of storage/commit.py).

An output folder is built in a hidden temporary sibling `.OUT.ckptkit-tmp-TOKEN` and put in
place only after every file was written and flushed; any failure removes it. A lock file next to
the target (storage/locks.py) keeps two runs from writing the same output at once, and its TOKEN
ties the temporary folder to the run that owns it. Before anything is written, OUT is checked
against the sources (storage/overlap.py): an output never touches its source.

`--overwrite` swaps the finished folder with the old OUT in one step (storage/swap.py), or, where
the system cannot, renames the old one to `.OUT.ckptkit-old-TOKEN` first; either way the old copy
is removed, and a run killed in between leaves names the next run's sweep recognises. A symlink
at OUT is replaced itself; its target is never written through.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, BinaryIO, Callable

from .. import interrupts
from ..errors import OutputError
from . import locks, swap
from .commit import FinishingFile, on_root
from .overlap import check_apart, relation
from .source import local_path

# what the system says when an output cannot be written, for no fault of ckptkit's: worded as one
# sentence (exit 2), where any other OSError is a bug's (exit 3)
_WRITE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ENOSPC",
        "EFBIG",
        "EDQUOT",
        "EIO",
        "EROFS",
        "EACCES",
        "EPERM",
        "ENAMETOOLONG",
        "EMFILE",
        "ENFILE",
        "ENOMEM",
        "EXDEV",
        "ESTALE",
        "ENODEV",
        "ENXIO",
    )
    if hasattr(errno, name)
)

if TYPE_CHECKING:
    from ..runner.distributed import Group

TMP_MARK = ".ckptkit-tmp-"
OLD_MARK = ".ckptkit-old-"


@interrupts.guard_output  # Ctrl-C while it is open: stop at a check point, remove, never commit
class RenameOutput:
    """A folder that appears at `path` complete, or not at all.

    In a distributed job every rank enters it: rank 0 takes the lock and creates the temporary
    folder (which every rank must see: a shared filesystem), every rank writes its own files into
    it, small files (`write_bytes`) come from rank 0 only, and rank 0 commits once every rank
    reported success. `sources` are the paths the run reads: OUT may not overlap any of them."""

    def __init__(self, path: str, *, overwrite: bool, group: Group, sources: Sequence[str | None]) -> None:
        self.path = os.path.abspath(local_path(path))
        self.overwrite = overwrite
        self.sources = tuple(sources)
        parent = os.path.dirname(self.path) or "."
        name = os.path.basename(self.path)
        self.token = uuid.uuid4().hex[:16]
        self.tmp = os.path.join(parent, f".{name}{TMP_MARK}{self.token}")
        self._lock_path = locks.lock_path_for(self.path)
        self._lock: locks.HeldLock | None = None
        self.group = group
        self._open_files: set[_SyncedFile] = set()  # written now; start_writeback's to flush
        self._files_lock = threading.Lock()  # a file closes only when no writeback is starting

    def __enter__(self) -> RenameOutput:
        try:
            self._enter_every_rank()
        except BaseException:
            # no `with` block runs, so no __exit__ removes what rank 0 made: a peer that failed (or
            # was stopped by Ctrl-C) in a collective after rank 0 took the lock and created the
            # temporary folder would leave both next to OUT
            if self.group.is_root:
                self.abort()
            raise
        return self

    def _enter_every_rank(self) -> None:
        on_root(self.group, self._enter)
        if not self.group.distributed:
            return
        self.tmp = self.group.share(self.tmp)
        seen = os.path.isdir(self.tmp)
        self.group.check(
            None
            if seen
            else OutputError(
                f"{self.path}: rank {self.group.rank} cannot see the output folder rank 0 created; a "
                f"distributed run needs OUT on a filesystem every rank shares"
            )
        )

    def _enter(self) -> RenameOutput:
        check_apart(self.sources, self.path)  # before anything is written
        self._check_parent()
        self._refuse_existing()
        try:
            self._lock = locks.acquire(self._lock_path, self.token, self.path)
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot take the lock {self._lock_path} ({exc.strerror})") from None
        try:
            sweep_dead_runs(self.path, self.token, keep=self.sources)
            self._refuse_existing()  # the sweep may have put back an OUT a killed run had moved away
            os.mkdir(self.tmp)
        except OSError as exc:
            self._release()
            raise OutputError(f"{self.path}: cannot create the output folder ({exc.strerror})") from None
        except BaseException:
            self._release()
            raise
        return self

    def _check_parent(self) -> None:
        parent = os.path.dirname(self.path)
        if self.path == parent:
            raise OutputError(f"{self.path}: a filesystem root cannot be an output")
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            raise OutputError(f"{self.path}: parent folder {parent} does not exist") from None
        except NotADirectoryError:
            raise OutputError(f"{self.path}: parent {parent} is not a folder (a file is in its path)") from None
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot reach the parent folder {parent} ({exc.strerror})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{self.path}: parent {parent} is a file, not a folder")

    def _refuse_unreplaceable(self) -> None:
        try:
            st = os.lstat(self.path)
        except OSError:
            return  # nothing there (or nothing to look at): the checks that follow word it
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise OutputError(
                f"{self.path}: is a device, FIFO or socket; --overwrite replaces only a file, a folder or a symlink"
            )
        if stat.S_ISDIR(st.st_mode):
            for what, folder in (("current folder", os.getcwd()), ("home folder", os.path.expanduser("~"))):
                real, out = os.path.realpath(folder), os.path.realpath(self.path)
                if real == out or real.startswith(out.rstrip(os.sep) + os.sep):
                    raise OutputError(
                        f"{self.path}: holds the {what} {folder}; --overwrite would delete it, "
                        f"so ckptkit refuses: choose another OUT"
                    )

    def _refuse_existing(self) -> None:
        """Without --overwrite, anything at OUT but an empty folder (a symlink, dangling or not,
        counts as something) is refused. With it, what is no file, folder or symlink (a device,
        a FIFO, a socket) and a folder that holds the current folder or the home folder are
        refused still: replacing them is never what a conversion meant."""
        if self.overwrite:
            self._refuse_unreplaceable()
            return
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot look at the output path ({exc.strerror})") from None
        if stat.S_ISDIR(st.st_mode):
            try:
                if not os.listdir(self.path):
                    return
            except OSError:
                pass
        what = "already exists as a symlink" if stat.S_ISLNK(st.st_mode) else "already exists"
        raise OutputError(f"{self.path}: output {what} (choose another path or pass --overwrite)")

    def file_path(self, rel: str) -> str:
        full = os.path.join(self.tmp, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        return full

    def open(self, rel: str) -> BinaryIO:
        """A new file; it is flushed to disk when closed, so the fsync of one output file
        overlaps the writing of the others instead of queueing up at commit."""
        full = self.file_path(rel)
        return _SyncedFile(open(full, "wb"), self)

    def track_open(self, f: _SyncedFile) -> None:
        """Count `f` among the open files `start_writeback` flushes."""
        with self._files_lock:
            self._open_files.add(f)

    def close_tracked(self, f: _SyncedFile, close: Callable[[], None]) -> None:
        """Take `f` out of the open files and `close` it, never while a writeback is starting (its
        descriptor would be flushed after it closed, and is reused)."""
        with self._files_lock:
            self._open_files.discard(f)
            close()

    def start_writeback(self) -> None:
        """Start writing what the open files hold to disk, without waiting for it (their fsync at
        close then waits for less): a run that reads ahead calls it from its own thread while the
        workers still copy, so the disk writes while they work instead of after. Only a hint:
        durability still comes from each file's fsync before the commit."""
        with self._files_lock:
            for f in self._open_files:
                try:  # Linux starts writeback of a range's dirty pages on DONTNEED (and drops its clean ones)
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                except (OSError, ValueError):
                    pass

    def write_bytes(self, rel: str, data: bytes) -> None:
        """A small file, written once (by rank 0 in a distributed job)."""
        if not self.group.is_root:
            return
        with self.open(rel) as f:
            f.write(data)

    def commit(self) -> None:
        """Put the finished temporary folder at OUT, replacing what is there (never through a
        symlink), and remove the old copy."""
        for root, _dirs, _files in os.walk(self.tmp):
            _fsync_dir(root)
        self._refuse_existing()  # without --overwrite, only an empty folder is replaced
        self._put_in_place(self.tmp)

    def _put_in_place(self, built: str) -> None:
        """Rename `built` (the finished folder, or file) to OUT in one step, replacing what is there."""
        try:
            if not os.path.lexists(self.path):
                swap.rename_new(built, self.path)
            elif swap.exchange(built, self.path):
                swap.remove_entry(built)  # the old OUT, now under our temporary name
            else:
                old = os.path.join(os.path.dirname(self.path), f".{os.path.basename(self.path)}{OLD_MARK}{self.token}")
                os.rename(self.path, old)
                try:
                    os.rename(built, self.path)
                except BaseException:
                    os.rename(old, self.path)
                    raise
                swap.remove_entry(old)
        except FileExistsError:
            raise OutputError(
                f"{self.path}: something else created the output path while this run was writing; nothing was replaced"
            ) from None
        except OSError as exc:
            raise OutputError(
                f"{self.path}: cannot put the finished output in place ({exc.strerror}); nothing was replaced"
            ) from None
        _fsync_dir(os.path.dirname(self.path))

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.group.distributed:
            self._exit_distributed(exc)
            return
        try:
            if exc_type is None:
                self.commit()
        finally:
            self.abort()
        failure = self._write_failure(exc)
        if failure is not None:
            raise failure from None

    def _write_failure(self, exc: BaseException | None, where: str = "") -> OutputError | None:
        """The sentence for an error the system gave while the output was being made (a full disk,
        a file size limit, a quota, an I/O error, a read-only or forbidden place), or None for any
        other exception. The output was abandoned before this runs: nothing was written."""
        if not isinstance(exc, OSError) or exc.errno not in _WRITE_ERRNOS:
            return None
        if exc.errno == errno.ENOSPC:
            return OutputError(f"{self.path}: no space left on device while writing{where}; nothing was written")
        named = exc.filename if isinstance(exc.filename, str) else None
        if (
            named
            and not os.path.abspath(named).startswith(os.path.abspath(self.tmp) + os.sep)
            and os.path.abspath(named) != os.path.abspath(self.tmp)
        ):
            return OutputError(f"{named}: {exc.strerror}{where}; nothing was written to {self.path}")
        return OutputError(f"{self.path}: {exc.strerror} while the output was being made{where}; nothing was written")

    def _exit_distributed(self, exc: BaseException | None) -> None:
        """Every rank reports; rank 0 commits only when all succeeded, then tells the others."""
        exc = self._write_failure(exc, f" (rank {self.group.rank})") or exc
        try:
            self.group.check(exc)
            on_root(self.group, self.commit)
        finally:
            if self.group.is_root:
                self.abort()

    def abort(self) -> None:
        """Remove the temporary folder and release the lock. Before a commit this abandons the
        output (OUT is as it was); after one, it removes what is left (a file output's folder)."""
        swap.remove_entry(self.tmp)
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


class RenameFileOutput(RenameOutput):
    """One file that appears at `path` complete, or not at all (`ckptkit convert --to torch
    model.pt`). It is written as `name` (OUT's own name) inside the same temporary folder, under the
    same lock and overlap checks as a folder, then renamed over OUT; the folder is then removed.
    Without overwrite, anything at OUT (an empty folder too) is refused."""

    def __init__(self, path: str, *, overwrite: bool, group: Group, sources: Sequence[str | None]) -> None:
        super().__init__(path, overwrite=overwrite, group=group, sources=sources)
        self.name = os.path.basename(self.path)

    def _refuse_existing(self) -> None:
        if self.overwrite:
            self._refuse_unreplaceable()
            return
        if not os.path.lexists(self.path):
            return
        raise OutputError(f"{self.path}: output already exists (choose another path or pass --overwrite)")

    def commit(self) -> None:
        built = os.path.join(self.tmp, self.name)
        if not os.path.isfile(built):
            raise OutputError(f"{self.path}: the run wrote no file {self.name}; nothing was replaced")
        _fsync_dir(self.tmp)
        self._refuse_existing()
        self._put_in_place(built)  # the temporary folder is removed afterwards, with the lock


def recover(path: str) -> bool:
    """Clean up after runs that died writing output `path` (for sweeps outside a write, e.g. the
    Checkpointer's restore): take OUT's lock if no live run holds it, sweep, release. False when
    a live (or foreign, or unreadable) lock is there and nothing was touched."""
    token = uuid.uuid4().hex[:16]
    try:
        lock = locks.acquire(locks.lock_path_for(path), token, path)
    except (OutputError, OSError):
        return False
    try:
        sweep_dead_runs(path, token)
    finally:
        lock.release()
    return True


def sweep_dead_runs(path: str, token: str, keep: Sequence[str | None] = ()) -> None:
    """Remove what killed runs left next to output `path`: temporary folders, pending lock files
    and old copies whose token is not `token`. Call it only while holding OUT's lock: a live run
    holds the lock for as long as its temporary folder exists, so every other token is a dead
    run's. An old copy a run moved away before it died is put back when OUT is missing. Nothing
    that is or holds one of the sources in `keep` is touched (a user may read a leftover)."""
    parent, name = os.path.dirname(path), os.path.basename(path)
    ours = re.compile(
        rf"\.{re.escape(name)}(\.ckptkit-tmp-|\.ckptkit-old-|{re.escape(locks.LOCK_SUFFIX)}-)"
        rf"([0-9a-f]+)"
    )
    legacy_old = re.compile(rf"{re.escape(name)}\.ckptkit-old-[0-9a-f]+")  # before 2026-12: not hidden
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for entry in names:
        match = ours.fullmatch(entry)
        full = os.path.join(parent, entry)
        if match is not None and match.group(2) == token:
            continue
        old = (match is not None and match.group(1) == OLD_MARK) or legacy_old.fullmatch(entry) is not None
        if match is None and not old:
            continue
        if any(src and relation(src, full) for src in keep):
            continue
        if old and not os.path.lexists(path):
            try:
                os.rename(full, path)
                continue
            except OSError:
                pass
        swap.remove_entry(full)


class _SyncedFile(FinishingFile):
    """Fsynced when closed, so one file's fsync overlaps the writing of the others. While open it
    is among its output's files that `start_writeback` may flush (closing waits for that)."""

    def __init__(self, f: BinaryIO, output: RenameOutput) -> None:
        super().__init__(f)
        self._output = output
        output.track_open(self)

    def _finish(self, ok: bool) -> None:
        try:
            if ok:
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._output.close_tracked(self, self._f.close)


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
