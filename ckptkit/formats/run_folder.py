"""Training output folders ("run folders"): the newest complete checkpoint among several.

Trainers save checkpoint after checkpoint into one folder. Pointed at such a folder, the
read-only commands read its newest COMPLETE checkpoint and say which one (a save killed half-way
leaves a newer folder that must not be read). Kinds, tried in this order:

- an HF Trainer `output_dir`: `checkpoint-N/` folders; complete = `trainer_state.json` is there
  (the Trainer writes it last) and the checkpoint inside opens whole (every rank file present);
- a ckptkit Checkpointer directory: `step_N/` folders, complete as formats/step_folders.py decides
  (its completion marker, or an unmarked folder ckptkit's reader indexes whole);
- a DeepSpeed save folder without `latest`: tag folders of ZeRO rank files; complete = the tag
  opens whole (every rank's files present);
- Lightning's `checkpoints/`: `*.ckpt` files or sharded checkpoint folders; complete = it opens whole.

Newest is by step: `checkpoint-N`, `step_N`, a tag's trailing number (`global_stepN`), Lightning's
`step=N`; where a name carries none (`last.ckpt`, a free-form tag), by modification time. The rule
used is said. `--tag NAME` picks an entry by name, `--step N` the entry of step N.

Entry names are untrusted: only ASCII digits count as a step (`checkpoint-3\n` or a step in
another script's digits is no entry); an entry linked outside the run folder is read only with
--follow-links, whether chosen or asked for; an entry that is itself a run folder is not read as
one (a link `checkpoint-9 -> .` would otherwise recurse). Choosing opens at most MAX_PROBED
entries, newest first: a folder of thousands of broken saves costs the same as one of eight.
"""

from __future__ import annotations

import contextvars
import os
import re
from dataclasses import dataclass
from typing import Callable

from ..errors import CkptkitError, NotACheckpointError, UsageError, name_of
from ..storage.source import LocalSource, Source
from . import step_folders
from .opened import Opened, Opener, RunChoice
from .structure import structural_problems

HF = "HF Trainer output folder"
CHECKPOINTER = "Checkpointer directory"
DEEPSPEED = "DeepSpeed save folder"
LIGHTNING = "Lightning checkpoints folder"

HF_ENTRY = re.compile(r"checkpoint-([0-9]+)")  # fullmatch: no trailing line break, ASCII digits only
TRAILING_NUMBER = re.compile(r"([0-9]+)\Z")
LIGHTNING_STEP = re.compile(r"(?:^|[-_])step=([0-9]+)")
TRAINER_STATE = "trainer_state.json"
MAX_TRAINER_STATE = 64 << 20
MAX_LISTED = 6
MAX_PROBED = 8  # entries opened (or their trainer state read) while looking for the newest complete one

# set while an entry of a run folder is being opened: an entry is read as a checkpoint, never as
# another run folder (no recursion through a link to the run folder itself)
_inside_entry: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptkit_run_folder_entry", default=False)

# what inspect/verify/... recognise as a run folder, for the message on an unrecognised folder
RECOGNISED = (
    "a run folder holding checkpoint-N/ (HF Trainer output_dir), step_N/ (ckptkit Checkpointer), "
    "DeepSpeed tag folders (global_stepN/) or *.ckpt (Lightning checkpoints/)"
)


@dataclass
class Entry:
    name: str
    step: int | None
    mtime: float = 0.0


# ---- announcing the choice (the CLI prints it on stderr) -------------------------------------

_listener: Callable[[str], None] | None = None
_said: set[str] = set()


def set_listener(fn: Callable[[str], None] | None) -> None:
    """Where notes about the checkpoint chosen in a run folder go (the CLI: one line on stderr)."""
    global _listener
    _listener = fn
    _said.clear()


def announce(choice: RunChoice) -> None:
    if _listener is not None and choice.note not in _said:  # a folder opened twice is said once
        _said.add(choice.note)
        _listener(choice.note)


# ---- detection ------------------------------------------------------------------------------


def _safe_listdir(source: Source, rel: str) -> list[str]:
    try:
        return source.listdir(rel)
    except CkptkitError:
        return []


def _is_dir(source: Source, name: str) -> bool:
    try:
        return source.isdir(name)
    except CkptkitError:
        return False


def detect(source: Source, names: list[str] | None = None) -> tuple[str, list[Entry]] | None:
    """(kind, entries oldest first) when the folder is a run folder, else None. A folder that is
    itself a checkpoint (DCP .metadata, DeepSpeed `latest` or rank files, accelerate's parts,
    safetensors weights beside no checkpoint-N/) is not one."""
    from . import accelerate
    from .deepspeed.names import LATEST, looks_like_tag_folder

    if not source.isdir(""):
        return None
    names = source.listdir("") if names is None else names
    if ".metadata" in names or looks_like_tag_folder(names):
        return None
    if LATEST in names and not source.isdir(LATEST):
        return (CHECKPOINTER, _checkpointer_entries(source, names)) if _points_to_step(source) else None
    hf = [Entry(n, int(m.group(1))) for n in names if (m := HF_ENTRY.fullmatch(n)) and _is_dir(source, n)]
    if hf:
        return HF, sorted(hf, key=lambda e: (e.step, e.name))
    if accelerate.parts(source):
        return None
    steps = _checkpointer_entries(source, names)
    if steps:
        return CHECKPOINTER, steps
    tags = [n for n in names if _is_dir(source, n) and looks_like_tag_folder(_safe_listdir(source, n))]
    if tags:
        return DEEPSPEED, _ordered(source, [Entry(n, _number(TRAILING_NUMBER, n)) for n in tags])
    if any(n.endswith(".safetensors") for n in names):
        return None
    ckpts = [n for n in names if n.endswith(".ckpt")]
    if ckpts:
        return LIGHTNING, _ordered(source, [Entry(n, _number(LIGHTNING_STEP, n)) for n in ckpts])
    return None


def _number(pattern: re.Pattern, name: str) -> int | None:
    m = pattern.search(name)
    return int(m.group(1)) if m else None


def _points_to_step(source: Source) -> bool:
    return isinstance(source, LocalSource) and step_folders.read_pointer(source.root) is not None


def _checkpointer_entries(source: Source, names: list[str]) -> list[Entry]:
    if not isinstance(source, LocalSource):  # the Checkpointer writes local folders only
        return []
    found = [Entry(n, s) for n in names if (s := step_folders.step_of(n)) is not None]
    return sorted(found, key=lambda e: (e.step, e.name))


def _ordered(source: Source, entries: list[Entry]) -> list[Entry]:
    """Oldest first: by the step in the names when every name has one, else by modification time."""
    for e in entries:
        e.mtime = _mtime(source, e.name)
    if all(e.step is not None for e in entries):
        return sorted(entries, key=lambda e: (e.step, e.mtime, e.name))
    return sorted(entries, key=lambda e: (e.mtime, e.name))


def _mtime(source: Source, name: str) -> float:
    if not isinstance(source, LocalSource):
        return 0.0
    try:
        return os.stat(os.path.join(source.root, name)).st_mtime
    except OSError:
        return 0.0


def _rule(kind: str, entries: list[Entry]) -> str:
    if kind in (DEEPSPEED, LIGHTNING) and not all(e.step is not None for e in entries):
        return " by modification time"
    return ""


# ---- choosing ----------------------------------------------------------------------------------


def resolvable(source: Source, tag: str | None = None) -> tuple[str, list[Entry]] | None:
    """(kind, entries) when `resolve` picks an entry of this folder, else None: a run folder with
    entries, outside an entry being opened, and not a DeepSpeed save folder given a --tag (a
    DeepSpeed save folder's --tag is left to the DeepSpeed reader, as for any DeepSpeed checkpoint).
    Inside an entry being opened, None: an entry is read as a checkpoint, not as another run folder."""
    if _inside_entry.get():
        return None
    found = detect(source)
    if found is None:
        return None
    kind, entries = found
    if not entries or kind == DEEPSPEED and tag is not None:
        return None
    return found


def resolve(
    path: str,
    source: Source,
    open_checkpoint: Opener,
    tag: str | None = None,
    follow_links: bool | None = None,
    found: tuple[str, list[Entry]] | None = None,
) -> RunChoice | None:
    """The checkpoint to read when `path` is a run folder (None when `resolvable` says it is not
    one; `found`: what it said): the entry `tag` names, or else the newest complete one, opened
    with `open_checkpoint` (the registry's, which resolves run folders here) to tell."""
    found = found or resolvable(source, tag)
    if found is None:
        return None
    kind, entries = found
    if tag is not None:
        return _asked(path, source, kind, entries, tag)
    return _newest_complete(path, source, kind, entries, follow_links, open_checkpoint)


def tag_for_step(path: str, source: Source, step: int) -> str:
    """--step N: the name of the entry of step N (passed on as --tag). Also a DeepSpeed checkpoint's
    `global_stepN` tag."""
    from .deepspeed import files as ds_files
    from .deepspeed.names import step_tag

    found = detect(source)
    if found is None:
        if source.isdir("") and ds_files.detect(source):
            if source.isdir(step_tag(step)):
                return step_tag(step)
            tags = [n for n in _safe_listdir(source, "") if TRAILING_NUMBER.search(n) and _is_dir(source, n)]
            raise UsageError(
                f"{path}: no tag {step_tag(step)} in this DeepSpeed checkpoint (tags: "
                f"{_list(name_of(n) for n in tags) or 'none'})"
            )
        raise UsageError(
            f"{path}: --step picks a checkpoint in a run folder ({RECOGNISED}) or a DeepSpeed "
            f"tag global_stepN, and this is neither"
        )
    kind, entries = found
    matching = [e.name for e in entries if e.step == step]
    if not matching:
        steps = ", ".join(str(e.step) for e in entries if e.step is not None) or "none in the names"
        raise UsageError(f"{path}: no checkpoint of step {step} in this {kind} (steps: {steps})")
    if len(matching) > 1:
        raise UsageError(
            f"{path}: step {step} is saved more than once ({', '.join(matching)}); pick one with --tag NAME"
        )
    return matching[0]


def _asked(path: str, source: Source, kind: str, entries: list[Entry], tag: str) -> RunChoice:
    chosen = next((e for e in entries if e.name == tag), None)
    if chosen is None:
        raise UsageError(
            f"{path}: no checkpoint {name_of(tag)} in this {kind} (it holds {_list(e.name for e in reversed(entries))})"
        )
    _inside_run_folder(source, chosen)
    why = _nested(path, source, kind, chosen)
    if why:
        raise NotACheckpointError(f"{path}: cannot read {name_of(chosen.name)}: {why}")
    step = _trainer_step(source, chosen.name, kind) if kind == HF else None
    return _choice(path, kind, chosen, step, f"as asked; {len(entries)} checkpoint(s) in this {kind}", [])


def _newest_complete(
    path: str, source: Source, kind: str, entries: list[Entry], follow_links: bool | None, open_checkpoint: Opener
) -> RunChoice:
    skipped: list[tuple[str, str]] = []
    probed = 0
    for e in reversed(entries):
        if probed >= MAX_PROBED:
            raise NotACheckpointError(
                f"{path}: a {kind} with {len(entries)} checkpoint(s), and the newest {MAX_PROBED} looked into are "
                f"incomplete ({'; '.join(f'{name_of(n)}: {w}' for n, w in skipped[:MAX_LISTED])}"
                f"{'; ...' if len(skipped) > MAX_LISTED else ''}); pick an older one with --step N or --tag NAME"
            )
        why, step, opened, costly = _problem(path, source, kind, e, follow_links, open_checkpoint)
        probed += costly
        if not why:
            why = f"newest complete of {len(entries)} in this {kind}{_rule(kind, entries)}"
            why += "".join(f"; {n} is incomplete: {w}" for n, w in skipped[:MAX_LISTED])
            choice = _choice(path, kind, e, step, why, skipped)
            choice.opened = opened
            return choice
        skipped.append((e.name, why))
    listed = "; ".join(f"{name_of(n)}: {w}" for n, w in skipped[:MAX_LISTED])
    more = f"; and {len(skipped) - MAX_LISTED} more" if len(skipped) > MAX_LISTED else ""
    raise NotACheckpointError(f"{path}: a {kind} with {len(entries)} checkpoint(s), none complete ({listed}{more})")


def _choice(path: str, kind: str, e: Entry, step: int | None, why: str, skipped: list[tuple[str, str]]) -> RunChoice:
    if kind == DEEPSPEED:  # opened as the user's own --tag would open it
        return RunChoice(path, kind, e.name, path, e.name, step if step is not None else e.step, why, skipped)
    sep = "" if path.endswith("/") else "/"
    return RunChoice(path, kind, e.name, path + sep + e.name, None, step if step is not None else e.step, why, skipped)


def _problem(
    path: str, source: Source, kind: str, e: Entry, follow_links: bool | None, open_checkpoint: Opener
) -> tuple[str, int | None, Opened | None, int]:
    """(why entry `e` is not a complete checkpoint, "" when it is; the step its trainer recorded;
    the entry opened, when it was; 1 when finding out listed or read the entry, 0 when a look at
    its name and a stat sufficed)."""
    try:
        _inside_run_folder(source, e)
    except CkptkitError as exc:
        return _short(str(exc)), None, None, 0
    if kind == CHECKPOINTER:
        folder = step_folders.examine(source.root, e.name, e.step, open_checkpoint)
        return folder.why, e.step, None, 1
    if kind == HF and not source.exists(f"{e.name}/{TRAINER_STATE}"):
        return f"no {TRAINER_STATE} (the Trainer writes it last)", None, None, 0
    why = _nested(path, source, kind, e)  # lists the entry: costly (10,000 links to the run folder...)
    if why:
        return why, None, None, 1
    step = None
    if kind == HF:
        try:
            step = _trainer_step(source, e.name, kind)
        except CkptkitError as exc:
            return _short(str(exc)), None, None, 1
    try:
        why, opened = _opens_whole(path, e, kind, follow_links, open_checkpoint)
        return why, step, opened, 1
    except CkptkitError as exc:
        return _short(str(exc)), step, None, 1


def _inside_run_folder(source: Source, e: Entry) -> None:
    """An entry linked outside the run folder is refused (naming the link) unless links may be
    followed: the run folder is the checkpoint the user named."""
    if isinstance(source, LocalSource):
        source.boundary.resolve(e.name, source.label(e.name))


def _nested(path: str, source: Source, kind: str, e: Entry) -> str:
    """Why entry `e` is not read ("" when it is): an HF or Lightning entry that is itself a run
    folder (a link to the run folder, a run folder saved inside another). DeepSpeed tags are
    opened in the run folder itself; Checkpointer steps are judged by step_folders.py."""
    if kind not in (HF, LIGHTNING) or not _is_dir(source, e.name):
        return ""
    from ..storage.source import open_source

    try:
        inner = detect(open_source(path.rstrip("/") + "/" + e.name, True))
    except CkptkitError as exc:
        return _short(str(exc))
    if inner is not None:
        return (
            f"is itself a run folder ({inner[0]}, {len(inner[1])} checkpoint(s)), not a checkpoint; point "
            f"ckptkit at it to read one of those"
        )
    return ""


def _opens_whole(
    path: str, e: Entry, kind: str, follow_links: bool | None, open_checkpoint: Opener
) -> tuple[str, Opened | None]:
    """Why the entry does not open as a whole checkpoint ("" when it does), and the entry opened:
    read as verify reads, every missing or damaged file counted (in a log of its own, apart from
    any verify running)."""
    from ..index import problems

    sep = "" if path.endswith("/") else "/"
    token = _inside_entry.set(True)
    try:
        with problems.collecting() as log:
            if kind == DEEPSPEED:
                opened = open_checkpoint(path, tag=e.name, follow_links=follow_links)
            else:
                opened = open_checkpoint(path + sep + e.name, follow_links=follow_links)
    finally:
        _inside_entry.reset(token)
    found = [p.message for p in log.problems] + structural_problems(opened)
    return (_short(found[0]), None) if found else ("", opened)


def _trainer_step(source: Source, name: str, kind: str) -> int | None:
    """trainer_state.json's global_step (the step the HF Trainer recorded), None when absent."""
    from ..errors import FormatError
    from ..safe_json import loads

    rel = f"{name}/{TRAINER_STATE}"
    if kind != HF or not source.exists(rel):
        return None
    size = source.size(rel)
    if size > MAX_TRAINER_STATE:
        raise FormatError(
            f"{source.label(rel)}: is {size:,} bytes, more than a trainer state ({MAX_TRAINER_STATE:,} at most)"
        )
    doc = loads(source.read(rel, 0, size), source.label(rel), "the trainer state", bounded=True)
    step = doc.get("global_step") if isinstance(doc, dict) else None
    return step if type(step) is int and step >= 0 else None  # not a bool, a float, a string, negative


def _short(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 300 else line[:297] + "..."


def _list(names) -> str:
    names = list(names)
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f", ... ({len(names)} in all)" if len(names) > MAX_LISTED else "")
