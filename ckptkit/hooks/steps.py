"""The Checkpointer's step folders, write side: `step_<N>` names, the completion marker written
last, and two complete folders of one step as an error. Which folders count is read in
formats/step_folders.py (run folders read Checkpointer directories too); `examine` here opens a
folder without a marker through the registry.
"""

from __future__ import annotations

import json
import os
import stat
import uuid

from ..errors import CkptkitError
from ..formats import step_folders
from ..formats.step_folders import MARKER, Folder, scan, step_of

__all__ = [
    "MARKER",
    "DuplicateStepError",
    "Folder",
    "default_name",
    "duplicate_error",
    "examine",
    "fsync_dir",
    "scan",
    "step_of",
    "write_marker",
]


class DuplicateStepError(CkptkitError):
    """Two complete folders hold the same step (e.g. `step_11` and `step_000000011`)."""


def default_name(step: int) -> str:
    return f"step_{step:09d}"


def examine(directory: str, name: str, step: int, verify_unmarked: bool = True) -> Folder:
    """Whether `directory/name` is a complete checkpoint of `step` (formats/step_folders.py). Without
    `verify_unmarked` a folder without a marker is not opened (retention never deletes those anyway)."""
    from ..formats.registry import open_checkpoint

    return step_folders.examine(directory, name, step, open_checkpoint if verify_unmarked else None)


def duplicate_error(directory: str, step: int, names: list[str]) -> DuplicateStepError:
    return DuplicateStepError(
        f"{directory}: step {step} is saved twice, in {' and '.join(names)} (both complete "
        f"checkpoints); remove or rename one of them"
    )


def write_marker(folder: str, step: int, fmt: str, world_size: int) -> None:
    """Record `folder` as a complete checkpoint: every file and its size, written atomically
    (temporary file, fsync, rename, fsync of the folder). Call it once every rank's save returned."""
    files: dict[str, int] = {}
    for root, _dirs, names in os.walk(folder):
        for n in names:
            full = os.path.join(root, n)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            if rel == MARKER or rel.startswith(MARKER + ".tmp-"):
                continue
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode):
                files[rel] = st.st_size
    doc = {
        "ckptkit": _version(),
        "step": step,
        "format": fmt,
        "world_size": world_size,
        "files": dict(sorted(files.items())),
    }
    tmp = os.path.join(folder, f"{MARKER}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(folder, MARKER))
    fsync_dir(folder)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ckptkit")
    except PackageNotFoundError:
        return "unknown"
