"""A Checkpointer directory as a reader sees it: which `step_<N>` folders count as checkpoints,
and the `latest` pointer file.

A folder counts only when it is complete. ckptkit proves that with a marker, `.ckptkit-complete`
(JSON: step, format, world size, ckptkit version, and every file with its size), written last
(hooks/steps.py writes it). A folder without a marker (written by ckptkit before markers existed)
counts only when ckptkit's own reader indexes it as a whole checkpoint of that step. Anything else
named like a step (empty, half-written, a file, a symbolic link, garbage) is a stray: skipped,
named to the user, never loaded, never deleted.

Step numbers are parsed, not padded: `step_11` and `step_000000011` are both step 11.

Below the registry (run folders choose among step folders while the registry resolves a path):
what opens an unmarked folder is the registry's open_checkpoint, passed in.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

from .. import safe_json
from ..errors import CkptkitError
from ..storage.paths import nameable
from .deepspeed.names import LATEST, step_tag
from .opened import Opener
from .structure import structural_problems

MARKER = ".ckptkit-complete"
FORMATS = ("dcp", "deepspeed")
MAX_MARKER_BYTES = 16 << 20
MAX_DEPTH = 8
_STEP_NAME = re.compile(r"step_([0-9]+)", re.ASCII)
POINTER = LATEST  # the folder name of the newest complete step (hooks/pointer.py writes it), named as DeepSpeed does
POINTER_MAX_BYTES = 1024


@dataclass(frozen=True)
class Folder:
    """One directory entry named like a step. `why` says why it does not count ("" when it does);
    `marked` means ckptkit's marker proves it complete (only those are ever deleted)."""

    name: str
    step: int
    complete: bool
    marked: bool
    why: str = ""


def step_of(name: str) -> int | None:
    """The step a folder name spells (`step_11`, `step_000000011`), or None."""
    m = _STEP_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def scan(directory: str) -> dict[int, list[str]]:
    """Entry names by step (any spelling), without looking inside them."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found: dict[int, list[str]] = {}
    for name in sorted(names):
        step = step_of(name)
        if step is not None:
            found.setdefault(step, []).append(name)
    return found


def examine(directory: str, name: str, step: int, open_checkpoint: Opener | None) -> Folder:
    """Whether `directory/name` is a complete checkpoint of `step`. A folder without a marker is
    opened with `open_checkpoint` (the registry's); without one it is not opened at all
    (retention never deletes those anyway)."""
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
    except OSError as exc:
        return Folder(name, step, False, False, f"cannot be read ({exc.strerror})")
    if stat.S_ISLNK(st.st_mode):
        return Folder(name, step, False, False, "is a symbolic link (ckptkit never writes one and does not follow it)")
    if not stat.S_ISDIR(st.st_mode):
        return Folder(name, step, False, False, "is not a folder")
    why = _not_plain(path, 0)
    if why:
        return Folder(name, step, False, False, why)
    doc, why = read_marker(path)
    if why:
        return Folder(name, step, False, False, why)
    if doc is not None:
        why = _marker_problem(path, doc, step)
        return Folder(name, step, not why, not why, why)
    if open_checkpoint is None:
        return Folder(name, step, False, False, f"has no {MARKER} (not verified)")
    why = _unmarked_problem(path, step, open_checkpoint)
    return Folder(name, step, not why, False, why)


def read_pointer(directory: str) -> str | None:
    """The folder name the pointer holds, or None when there is none or it names no step folder
    (anything else there, e.g. a link, a FIFO or garbage, is ignored: restore then lists)."""
    try:
        fd = os.open(os.path.join(directory, POINTER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, POINTER_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    return name if len(raw) <= POINTER_MAX_BYTES and step_of(name) is not None else None


def _not_plain(path: str, depth: int) -> str:
    """Why the tree under `path` is not made of plain folders and regular files ("" when it is):
    ckptkit writes nothing else, and a link, FIFO or device there could point reads anywhere."""
    if depth > MAX_DEPTH:
        return f"is nested deeper than {MAX_DEPTH} folders"
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except OSError as exc:
        return f"cannot be listed ({exc.strerror})"
    for e in entries:
        if e.is_symlink():
            return f"holds a symbolic link, {e.name}"
        if e.is_dir(follow_symlinks=False):
            why = _not_plain(e.path, depth + 1)
            if why:
                return why
        elif not e.is_file(follow_symlinks=False):
            return f"holds {e.name}, which is not a regular file"
    return ""


def read_marker(path: str) -> tuple[dict | None, str]:
    """(the marker's JSON or None when there is none, why it is unusable)."""
    full = os.path.join(path, MARKER)
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"has a {MARKER} that cannot be read ({exc.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"has a {MARKER} that is not a regular file"
        if st.st_size > MAX_MARKER_BYTES:
            return None, f"has a {MARKER} of {st.st_size} bytes (at most {MAX_MARKER_BYTES} expected)"
        raw = os.read(fd, st.st_size + 1)
    except OSError as exc:
        return None, f"has a {MARKER} that cannot be read ({exc.strerror})"
    finally:
        os.close(fd)
    try:
        doc = safe_json.loads(raw, full, MARKER)
    except CkptkitError:
        return None, f"has a {MARKER} that is not JSON"
    if not isinstance(doc, dict):
        return None, f"has a {MARKER} that is not a JSON object"
    return doc, ""


def _marker_problem(path: str, doc: dict, step: int) -> str:
    """Why the marker does not prove `path` a complete checkpoint of `step` ("" when it does)."""
    got, fmt, world, files = doc.get("step"), doc.get("format"), doc.get("world_size"), doc.get("files")
    if type(got) is not int or got != step:
        return f"has a {MARKER} for step {got!r:.40}, not {step}"
    if fmt not in FORMATS:
        return f"has a {MARKER} naming format {fmt!r:.40}, expected one of {', '.join(FORMATS)}"
    if type(world) is not int or world < 1:
        return f"has a {MARKER} with world_size {world!r:.40}, expected a positive int"
    if not isinstance(files, dict) or not files:
        return f"has a {MARKER} without its list of files"
    needed = ".metadata" if fmt == "dcp" else f"{step_tag(step)}/"
    if not any(rel == needed if fmt == "dcp" else rel.startswith(needed) for rel in files if isinstance(rel, str)):
        return f"has a {MARKER} listing no {needed} (a {fmt} checkpoint of step {step} has one)"
    for rel, size in files.items():
        parts = rel.split("/") if isinstance(rel, str) and nameable(rel) else []
        if not parts or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            return f"has a {MARKER} listing {rel!r:.80}, which is not a path inside the folder"
        try:
            st = os.lstat(os.path.join(path, *parts))
        except OSError:
            return f"lacks {rel}, which its {MARKER} lists"
        if not stat.S_ISREG(st.st_mode) or type(size) is not int or st.st_size != size:
            return f"has {rel} of {st.st_size} bytes, its {MARKER} says {size!r:.40}"
    return ""


def unmarked_format(folder: str) -> str:
    """The format of a step folder from before markers: a DeepSpeed engine's save has `latest`."""
    return "deepspeed" if os.path.exists(os.path.join(folder, LATEST)) else "dcp"


def _unmarked_problem(path: str, step: int, open_checkpoint: Opener) -> str:
    """A folder from before markers counts when ckptkit's reader indexes it whole: a DeepSpeed
    save of tag global_step<step>, or a DCP save whose `ckptkit.step` record is `step`."""
    try:
        names = os.listdir(path)
        if not names:
            return f"is an empty folder without {MARKER}"
        if LATEST in names:  # a DeepSpeed engine's save
            opened = open_checkpoint(path, tag=step_tag(step))
        else:
            opened = open_checkpoint(path, expect="dcp")
            record = opened.index.objects.get("ckptkit.step")
            value = record.value if record is not None else None
            if type(value) is not int or value != step:
                return f"has no {MARKER} and is a DCP checkpoint whose ckptkit.step record is {value!r:.40}, not {step}"
        problems = structural_problems(opened)
    except CkptkitError as exc:
        return f"has no {MARKER} and is not a complete checkpoint ({_short(str(exc))})"
    except Exception as exc:  # a stray must never stop a restore; it is named instead
        return f"has no {MARKER} and cannot be read ({type(exc).__name__}: {_short(str(exc))})"
    if problems:
        return f"has no {MARKER} and is not a complete checkpoint ({_short(problems[0])})"
    return ""


def _short(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 200 else line[:197] + "..."
