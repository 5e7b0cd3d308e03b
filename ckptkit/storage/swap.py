"""Putting a finished output in place of whatever is at OUT, in one step where the system allows.

Linux's renameat2 can exchange two names atomically (RENAME_EXCHANGE) and rename without
replacing (RENAME_NOREPLACE). With them `--overwrite` never has a moment with no OUT, and the old
output ends up under the temporary name, which any later sweep removes. Where they are missing
(other systems, some filesystems) the caller falls back to two renames.

Both work on names, never through them: when OUT is a symlink, the link itself is replaced and its
target is not touched.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from functools import lru_cache
from typing import Any

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


@lru_cache(maxsize=None)
def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _call(src: str, dst: str, flags: int) -> bool:
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), dst)


def exchange(a: str, b: str) -> bool:
    """Swap the names `a` and `b` atomically; False where the system cannot (nothing changed)."""
    return _call(a, b, _RENAME_EXCHANGE)


def rename_new(src: str, dst: str) -> None:
    """Rename `src` to `dst`, failing with FileExistsError if `dst` appeared meanwhile (atomic
    where renameat2 exists; elsewhere checked just before)."""
    if _call(src, dst, _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def remove_entry(path: str) -> None:
    """Remove whatever is at `path` without following links: a folder with everything in it
    (read-only subfolders too), a file, a symlink. Best effort: errors are left for later sweeps."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):  # a read-only folder inside: make folders writable, then again
        _writable(path)
        for root, dirs, _files in os.walk(path):  # top-down: children are fixed before entered
            for name in dirs:
                _writable(os.path.join(root, name))
        shutil.rmtree(path, ignore_errors=True)


def _writable(folder: str) -> None:
    try:
        if not os.path.islink(folder):
            os.chmod(folder, 0o700)
    except OSError:
        pass
