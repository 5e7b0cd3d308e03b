"""An output never touches its source: refused before anything is written.

OUT must not be SRC, lie inside SRC, contain SRC, or be (a hard link to) a file of SRC. Paths
alone can lie (symlinks, bind mounts, `..`), so the check compares both ways: the real paths,
and (st_dev, st_ino) of every existing ancestor of OUT against SRC (and of SRC against OUT).
Remote URLs are compared by storage and path. Every output runs this (storage/output.py).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from ..errors import OutputError
from .source import is_url, local_path

MAX_WALK = 200_000  # entries of a source folder looked at for a hard link to OUT


def check_apart(sources: Iterable[str | None], out: str) -> None:
    """OutputError naming both paths when writing `out` would change one of `sources`."""
    for src in sources:
        if not src:
            continue
        why = relation(src, out)
        if why:
            raise OutputError(
                f"{out}: this output {why.format(src=src)}, and ckptkit never writes over or "
                f"into its source; choose an OUT outside it"
            )


def relation(src: str, out: str) -> str | None:
    """How `out` overlaps `src` in words ("is the source {src}", ...), or None when they are apart."""
    if is_url(src) or is_url(out):
        return _remote_relation(src, out) if is_url(src) and is_url(out) else None
    return _local_relation(os.path.abspath(local_path(src)), os.path.abspath(local_path(out)))


def _under(child: str, parent: str) -> bool:
    return child != parent and child.startswith(parent.rstrip(os.sep) + os.sep)


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def _same(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    return a is not None and b is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _ancestors(path: str) -> list[str]:
    found = []
    while True:
        up = os.path.dirname(path)
        if up == path:
            return found
        found.append(up)
        path = up


def _local_relation(src: str, out: str) -> str | None:
    src_real, out_real = os.path.realpath(src), os.path.realpath(out)
    src_st, out_st = _stat(src), _stat(out)
    if src == out or src_real == out_real or _same(src_st, out_st):
        return "is the source {src}"
    if _under(out, src) or _under(out_real, src_real):
        return "is inside the source {src}"
    if src_st is not None and stat.S_ISDIR(src_st.st_mode):
        if any(_same(_stat(a), src_st) for a in {*_ancestors(out), *_ancestors(out_real)}):
            return "is inside the source {src}"
    if _under(src, out) or _under(src_real, out_real):
        return "contains the source {src}"
    if out_st is not None and stat.S_ISDIR(out_st.st_mode):
        if any(_same(_stat(a), out_st) for a in {*_ancestors(src), *_ancestors(src_real)}):
            return "contains the source {src}"
    if (
        out_st is not None
        and stat.S_ISREG(out_st.st_mode)
        and src_st is not None
        and stat.S_ISDIR(src_st.st_mode)
        and _holds_inode(src_real, out_st)
    ):
        return "is a file of the source {src} (a hard link or a symlink to one of its files)"
    if src_st is not None and stat.S_ISDIR(src_st.st_mode):
        return _link_relation(src_real, out_real)
    return None


def _link_relation(src_real: str, out_real: str) -> str | None:
    """A source's files may really live elsewhere (a Hugging Face snapshot's links into blobs/, or
    any link read with --follow-links): OUT may not be or contain what they lead to."""
    for link, target in _link_targets(src_real):
        shown = link.replace("{", "{{").replace("}", "}}")
        if target == out_real or _under(target, out_real):
            return f"holds the file the source {{src}} reads through its link {shown}"
    return None


def _link_targets(folder: str) -> list[tuple[str, str]]:
    """(link, real target) of every symbolic link under `folder` (links to folders not entered)."""
    found, seen, stack = [], 0, [folder]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_WALK:
                return found
            try:
                if entry.is_symlink():
                    found.append((entry.path, os.path.realpath(entry.path)))
                elif entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
            except (OSError, ValueError):
                continue
    return found


def _holds_inode(folder: str, target: os.stat_result) -> bool:
    """Whether a file under `folder` (a symlink followed) is the inode `target`."""
    seen, stack = 0, [folder]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_WALK:
                return False
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif _same(entry.stat(follow_symlinks=True), target):
                    return True
            except OSError:
                continue
    return False


def _remote_relation(src: str, out: str) -> str | None:
    """Two URLs on the same storage: compare their paths."""
    try:
        import fsspec

        fs_src, path_src = fsspec.core.url_to_fs(src)
        fs_out, path_out = fsspec.core.url_to_fs(out)
        if type(fs_src) is not type(fs_out):
            return None
    except Exception:  # an unknown protocol: compare the URLs as written
        path_src, path_out = src, out
    a, b = path_src.rstrip("/"), path_out.rstrip("/")
    if a == b:
        return "is the source {src}"
    if b.startswith(a + "/"):
        return "is inside the source {src}"
    if a.startswith(b + "/"):
        return "contains the source {src}"
    return None
