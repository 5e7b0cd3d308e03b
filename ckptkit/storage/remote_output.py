"""Outputs on remote storage (s3://, gs://, memory://, ... through fsspec), committed by a marker
(the `MarkerOutput` side of storage/commit.py).

Object stores cannot rename a folder atomically, so the commit is a marker: `.ckptkit-incomplete`
is written first, every file is uploaded, then `.ckptkit-complete` (listing the files and their
sizes) is written and the first marker removed. ckptkit's readers refuse a folder that holds the
first marker without the second, with one sentence; a failed run removes what it uploaded.

Each output file is written to a local spool file first (the writers seek, and copy bytes in the
kernel into it) and uploaded when it is closed, then deleted: the spool holds only the files in
flight (`CKPTKIT_SPOOL` chooses its folder). There is no lock: two runs writing the same remote
OUT at once are not detected.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, BinaryIO

from .. import interrupts
from ..errors import OutputError
from .commit import FinishingFile, on_root
from .overlap import check_apart
from .url_fs import backend_errors, filesystem

if TYPE_CHECKING:
    from ..runner.distributed import Group

INCOMPLETE = ".ckptkit-incomplete"
COMPLETE = ".ckptkit-complete"


@interrupts.guard_output  # Ctrl-C while it is open: stop at a check point, remove, never commit
class MarkerOutput:
    """A remote folder that readers take as complete only once its commit marker is there.

    In a distributed job every rank uploads its own files; rank 0 writes the markers and the
    small files (`write_bytes`), and the final marker only after every rank reported success."""

    def __init__(self, path: str, *, overwrite: bool, group: Group, sources: Sequence[str | None]) -> None:
        self.path = path.rstrip("/")
        self.overwrite = overwrite
        self.sources = tuple(sources)
        self.group = group
        self.fs, self.base = filesystem(self.path, OutputError)  # the same sentences as for a SRC
        self.tmp = ""  # no temporary folder: the markers commit
        self._spool: str | None = None
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _remote(self, rel: str) -> str:
        return f"{self.base}/{rel}"

    def _enter(self) -> MarkerOutput:
        check_apart(self.sources, self.path)  # before anything is written or removed
        try:
            existing = self.fs.ls(self.base, detail=False) if self.fs.exists(self.base) else []
            if existing and not self.overwrite:
                raise OutputError(f"{self.path}: output already exists (choose another path or pass --overwrite)")
            if existing:
                self.fs.rm(self.base, recursive=True)
            self.fs.pipe_file(self._remote(INCOMPLETE), b"a ckptkit write is in progress or did not finish\n")
        except OutputError:
            raise
        except Exception as exc:  # credentials, endpoint, permissions: one sentence
            raise OutputError(f"{self.path}: cannot write there ({type(exc).__name__}: {str(exc)[:200]})") from None
        return self

    def __enter__(self) -> MarkerOutput:
        on_root(self.group, self._enter)
        self._spool = tempfile.mkdtemp(prefix="ckptkit-spool-", dir=os.environ.get("CKPTKIT_SPOOL"))
        return self

    def file_path(self, rel: str) -> str:
        assert self._spool is not None
        full = os.path.join(self._spool, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        return full

    def open(self, rel: str) -> BinaryIO:
        local = self.file_path(rel)
        return _UploadingFile(open(local, "w+b"), local, self, rel)  # type: ignore[return-value]

    def _uploaded(self, rel: str, local: str) -> None:
        size = os.path.getsize(local)
        try:
            self.fs.put_file(local, self._remote(rel))
        except Exception as exc:
            raise OutputError(f"{self.path}: uploading {rel} failed ({type(exc).__name__}: {str(exc)[:200]})") from None
        finally:
            os.unlink(local)
        with self._lock:
            self._sizes[rel] = size

    def write_bytes(self, rel: str, data: bytes) -> None:
        if not self.group.is_root:
            return
        with backend_errors(self.path, f"writing {rel}", OutputError):
            self.fs.pipe_file(self._remote(rel), data)
        with self._lock:
            self._sizes[rel] = len(data)

    def commit(self) -> None:
        """Write the final marker (every rank's files and sizes), then remove the first one."""
        sizes: dict[str, int] = {}
        for part in self.group.gather_all(dict(self._sizes)):
            sizes.update(part)
        if self.group.is_root:
            doc = {"files": dict(sorted(sizes.items()))}
            with backend_errors(self.path, "committing it", OutputError):
                self.fs.pipe_file(self._remote(COMPLETE), json.dumps(doc, indent=1).encode())
                self.fs.rm(self._remote(INCOMPLETE))

    def abort(self) -> None:
        """Remove everything uploaded (rank 0). Should that fail, the first marker stays and
        readers still refuse the folder."""
        if self.group.is_root:
            try:
                self.fs.rm(self.base, recursive=True)
            except Exception:
                pass  # the INCOMPLETE marker, written first, still tells readers

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if not self.group.distributed:
                if exc_type is None:
                    self.commit()
                else:
                    self.abort()
                return
            try:
                self.group.check(exc)
            except BaseException:
                self.abort()
                raise
            error: BaseException | None = None
            try:
                self.commit()
            except BaseException as e:
                error = e
            self.group.check(error)
        finally:
            if self._spool:
                shutil.rmtree(self._spool, ignore_errors=True)


class _UploadingFile(FinishingFile):
    """A local spool file that is uploaded to the remote OUT when closed."""

    def __init__(self, f: BinaryIO, local: str, out: MarkerOutput, rel: str) -> None:
        super().__init__(f)
        self._local, self._out, self._rel = local, out, rel

    def _finish(self, ok: bool) -> None:
        self._f.close()
        if ok:
            self._out._uploaded(self._rel, self._local)
        elif os.path.exists(self._local):
            os.unlink(self._local)
