"""The Checkpointer's pointer file, `DIRECTORY/latest`: the folder name of the newest complete
step (e.g. `step_000000005`), as DeepSpeed's `latest` names its newest tag. Rank 0 writes it
last, after the commit and retention, atomically (temporary file, fsync, rename, fsync of the
folder), so other tools can find the newest step without listing the folder. ckptkit itself
trusts it only when it names a complete step and no newer folder is there (see restore). It is
read in formats/step_folders.py (`read` here), where run folders read it too."""

from __future__ import annotations

import os
import re
import uuid

from ..formats.step_folders import POINTER as NAME, read_pointer as read
from .steps import fsync_dir

__all__ = ["NAME", "read", "sweep", "write"]

TMP_PREFIX = f".{NAME}.tmp-"
_TMP = re.compile(rf"{re.escape(TMP_PREFIX)}([0-9]+)-[0-9a-f]{{8}}", re.ASCII)


def write(directory: str, folder_name: str) -> None:
    """Point `latest` at `folder_name` atomically. When that fails (a folder named `latest` in the
    way, a full disk) the temporary is removed before the error is raised: sweep() only removes
    those of dead processes, and this one lives on."""
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(folder_name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, NAME))
    except BaseException:
        _unlink(tmp)
        raise
    fsync_dir(directory)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def sweep(directory: str) -> None:
    """Remove the temporaries of pointer writes whose process is gone (killed between writing and
    renaming); a live writer's is left alone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for n in names:
        m = _TMP.fullmatch(n)
        if m and not _alive(int(m.group(1))):
            _unlink(os.path.join(directory, n))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True
