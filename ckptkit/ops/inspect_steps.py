"""`ckptkit inspect DIR` of a Checkpointer directory: its steps (complete or not and why, format,
world size, size on disk), the newest complete one and what the pointer file names. Read only:
markers and sizes, no payload (folders from before markers are indexed to tell)."""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from typing import Callable

from ..formats import step_folders
from ..formats.registry import open_checkpoint
from ..formats.step_folders import POINTER


@dataclass
class StepRow:
    step: int
    folder: str
    complete: bool
    why: str  # why it does not count ("" when it does)
    format: str  # dcp, deepspeed or "-"
    world_size: int | None
    bytes: int


def is_checkpointer_dir(path: str) -> bool:
    """A local folder holding folders named like steps, itself no checkpoint (no DCP .metadata,
    no DeepSpeed `latest` naming a tag other than a step folder)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, ".metadata")):
        return False
    if not step_folders.scan(path):
        return False
    latest = os.path.join(path, POINTER)
    return not os.path.lexists(latest) or step_folders.read_pointer(path) is not None


@dataclass
class StepsReport:
    """What `inspect` shows of a Checkpointer directory."""

    path: str
    rows: list[StepRow]
    latest: str | None  # the folder name the pointer file holds


def describe(path: str) -> StepsReport:
    """Every entry named like a step, oldest first, and the pointer file's folder name."""
    rows: list[StepRow] = []
    for step, names in sorted(step_folders.scan(path).items()):
        for name in names:
            f = step_folders.examine(path, name, step, open_checkpoint)
            doc, _ = step_folders.read_marker(os.path.join(path, name)) if f.complete else (None, "")
            fmt = (
                doc.get("format")
                if f.marked and doc
                else ("-" if not f.complete else step_folders.unmarked_format(os.path.join(path, name)))
            )
            world = doc.get("world_size") if f.marked and doc else None
            rows.append(StepRow(step, name, f.complete, f.why, str(fmt), world, _size(os.path.join(path, name))))
    return StepsReport(path, rows, step_folders.read_pointer(path))


def newest_complete(rows: list[StepRow]) -> StepRow | None:
    done = [r for r in rows if r.complete]
    return done[-1] if done else None


def render(report: StepsReport, human_bytes: Callable[[int], str]) -> list[str]:
    """The newest complete step, then one line per step folder. Names as on disk: the printer
    escapes each line."""
    path, rows, latest = report.path, report.rows, report.latest
    done = [r for r in rows if r.complete]
    newest = newest_complete(rows)
    lines = [
        f"checkpointer  {path}",
        f"steps         {len(done)} complete of {len(rows)} folder(s) named like steps",
        f"newest        {f'step {newest.step} ({newest.folder})' if newest else '- (no complete step)'}",
        f"pointer       {POINTER} -> {latest}" if latest else f"pointer       no {POINTER} file",
        "",
        f"{'step':>10}  {'folder':<20} {'format':<9} {'world':>5} {'size':>10}  state",
    ]
    for r in rows:
        state = "complete" if r.complete else f"skipped: {r.why}"
        world = str(r.world_size) if r.world_size is not None else "-"
        lines.append(f"{r.step:>10}  {r.folder:<20} {r.format:<9} {world:>5} {human_bytes(r.bytes):>10}  {state}")
    return lines


def to_json(report: StepsReport) -> dict:
    newest = newest_complete(report.rows)
    return {
        "checkpointer": report.path,
        "steps": [asdict(r) for r in report.rows],
        "latest": report.latest,
        "newest_complete": newest.step if newest else None,
    }


def _size(path: str) -> int:
    """Bytes of the regular files under `path`, links not followed."""
    total = 0
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if not stat.S_ISDIR(st.st_mode):
        return 0
    for root, _dirs, files in os.walk(path):
        for n in files:
            try:
                s = os.lstat(os.path.join(root, n))
            except OSError:
                continue
            if stat.S_ISREG(s.st_mode):
                total += s.st_size
    return total
