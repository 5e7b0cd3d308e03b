"""Which step folders of a Checkpointer directory count, which one to restore, which to keep.

Retention is a keep policy in the manner of Orbax's `PreservationPolicy`: `decide_retention` only
decides (the newest `keep` complete steps and the step just written are kept; of the other steps
only folders ckptkit's marker proves complete are marked for deletion: strays, user files and
folders from before markers never are); the Checkpointer then deletes exactly the marked folders
(`remove_step_folder`). Rank 0 runs all of this: the directory is shared.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import OutputError, UsageError
from ..storage.rename_output import recover
from . import pointer
from . import steps as step_folders
from .steps import Folder

TMP_MARK = ".ckptkit-tmp-"
# what a RenameOutput leaves next to a step when a save is killed (storage/rename_output.py, locks.py):
# `.step_N.ckptkit-tmp-T`, `.step_N.ckptkit-old-T`, `.step_N.ckptkit-lock[-T]`, older `step_N.ckptkit-old-T`
LEFTOVER = re.compile(
    r"\.(step_[0-9]+)\.ckptkit-(?:tmp-|old-|lock).*|(step_[0-9]+)\.ckptkit-old-[0-9a-f]+", re.ASCII | re.DOTALL
)


# ---- listing and choosing ---------------------------------------------------------------


def complete_folder(directory: str, step: int, names: list[str]) -> Folder | None:
    """The complete folder of `step` among `names`; two of them are an error naming both."""
    good = [f for n in names if (f := step_folders.examine(directory, n, step)).complete]
    if len(good) > 1:
        raise step_folders.duplicate_error(directory, step, [f.name for f in good])
    return good[0] if good else None


def complete_steps(directory: str) -> list[int]:
    """Steps of the complete checkpoints, oldest first (strays are not listed)."""
    names = step_folders.scan(directory)
    return [s for s in sorted(names) if complete_folder(directory, s, names[s]) is not None]


def choose(directory: str, step: int | None) -> tuple[Folder | None, list[Folder]]:
    """(the folder to restore, the strays newer than it, newest first). Only as many folders
    are opened as it takes to find the newest complete one."""
    names = step_folders.scan(directory)
    if step is not None:
        found = complete_folder(directory, step, names.get(step, []))
        if found is None:
            have = ", ".join(map(str, complete_steps(directory)[-8:])) or "none"
            raise UsageError(
                f"{directory}: has no complete checkpoint of step {step} (complete steps, newest last: {have})"
            )
        return found, []
    latest = pointer.read(directory)
    newest = max(names, default=None)
    if latest is not None and newest is not None and names[newest] == [latest]:
        found = complete_folder(directory, newest, names[newest])  # the pointer, trusted once checked
        if found is not None and found.name == latest:
            return found, []
    skipped: list[Folder] = []
    for s in sorted(names, reverse=True):
        folders = [step_folders.examine(directory, n, s) for n in names[s]]
        good = [f for f in folders if f.complete]
        skipped += [f for f in folders if not f.complete]
        if len(good) > 1:
            raise step_folders.duplicate_error(directory, s, [f.name for f in good])
        if good:
            return good[0], skipped
    return None, skipped


def target_name(directory: str, step: int, overwrite: bool) -> str:
    """The folder name save(step) writes: the default spelling, or with `overwrite` the one
    already there (so no second spelling appears). Without it, anything there is refused."""
    names = step_folders.scan(directory).get(step, [])
    if not names:
        return step_folders.default_name(step)
    found = complete_folder(directory, step, names)
    if not overwrite:
        if found is not None:
            raise OutputError(
                f"{os.path.join(directory, found.name)}: step {step} is already saved (a "
                f"complete checkpoint); pass overwrite=True to replace it"
            )
        stray = step_folders.examine(directory, names[0], step)
        raise OutputError(
            f"{os.path.join(directory, stray.name)}: is in the way of step {step} and is not "
            f"a complete checkpoint (it {stray.why}); ckptkit leaves it alone: move it away or "
            f"pass overwrite=True to replace it"
        )
    if found is not None:
        return found.name
    return step_folders.default_name(step) if step_folders.default_name(step) in names else names[0]


def sweep(directory: str) -> None:
    """Clean up after saves that were killed: for every step with leftovers (hidden temporaries,
    aside copies of a replaced step, locks) the output's own `recover` takes the step's lock when
    no live run holds it, removes the dead runs' leftovers, puts an aside copy back when a kill
    came between the two renames of an overwrite, and lets go."""
    try:
        listed = os.listdir(directory)
    except OSError:
        return
    targets = {m.group(1) or m.group(2) for n in listed if (m := LEFTOVER.fullmatch(n))}
    for target in sorted(targets):
        recover(os.path.join(directory, target))
    pointer.sweep(directory)


# ---- retention: decide, then delete the marked --------------------------------------------


@dataclass(frozen=True)
class Retention:
    """What the keep policy decided: nothing is deleted by deciding."""

    kept: tuple[int, ...]  # the newest `keep` complete steps, newest first
    newest: str  # the newest complete step's folder, which the pointer names ("" when none)
    delete: tuple[str, ...]  # folders marked for deletion, oldest step first


def decide_retention(
    names: Mapping[int, Sequence[str]],
    keep: int,
    written: int,
    complete: Callable[[int, str], bool],
    marked: Callable[[int, str], bool],
) -> Retention:
    """Keep the newest `keep` steps that have a complete folder, and `written`; of every other
    step mark for deletion the folders `marked` says carry ckptkit's completion marker. Folders
    are asked about lazily, newest first, only as far as the decision needs (`complete` may open
    a folder from before markers). Pure: it deletes nothing."""
    kept: list[int] = []
    newest = ""
    for step in sorted(names, reverse=True):
        if len(kept) == keep:
            break
        done = [n for n in names[step] if complete(step, n)]
        if done:
            kept.append(step)
            newest = newest or done[0]
    delete = [n for step in sorted(set(names) - set(kept) - {written}) for n in names[step] if marked(step, n)]
    return Retention(kept=tuple(kept), newest=newest, delete=tuple(delete))


def retention(directory: str, keep: int, written: int) -> Retention:
    """The keep policy's decision for `directory` as its folders are now (reads, never deletes)."""
    return decide_retention(
        step_folders.scan(directory),
        keep,
        written,
        complete=lambda step, name: step_folders.examine(directory, name, step).complete,
        marked=lambda step, name: step_folders.examine(directory, name, step, verify_unmarked=False).marked,
    )


def remove_step_folder(directory: str, name: str) -> None:
    """Delete a step folder: first renamed to a hidden temporary (gone from listings at once),
    then removed; a crash in between leaves a temporary the next restore sweeps."""
    hidden = os.path.join(directory, f".{name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        os.rename(os.path.join(directory, name), hidden)
    except OSError:
        return
    shutil.rmtree(hidden, ignore_errors=True)  # a real folder: examine() refuses links
