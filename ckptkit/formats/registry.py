"""The one registry of formats: find what a path is, build its index, and answer what a format
can do.

Every command takes a path (a folder or a file) and lands in `open_checkpoint`: one loop over one
ordered list, ORDER (the folder kinds of formats/kinds.py: run folder, HF Trainer folder,
Lightning's sharded folder, accelerate's folder; then every registered format in precedence
order). The first kind whose `detect` is positive opens the path; a detect never says "and not
another kind", precedence is the list's order. Detection is by content (DCP's .metadata,
safetensors headers, torch.save's zip magic), never by trust in a name alone; a path nothing
recognises gets one sentence saying what was looked for and what was found.

The formats are Reader/Writer adapters (each format package's format.py, the contract in
protocols.py), registered once in FORMATS (`register`) with their capabilities. Operations ask
`capabilities_of(index)` or `format_of(index)`, never compare format names, and import nothing
inside a format package.
"""

from __future__ import annotations

import os

from ..errors import NotACheckpointError, UnsupportedError, name_of
from ..index.types import CheckpointIndex
from ..runner.heap import paused_collector
from ..storage.source import Source, is_url, local_path, open_source
from . import accelerate, lightning, run_folder
from .dcp.format import DCP
from .deepspeed.format import DEEPSPEED
from .ds_universal.format import DS_UNIVERSAL
from .mcore.format import MCORE
from .kinds import AccelerateKind, FormatKind, Kind, LightningKind, RunFolderKind, Spot, TrainerKind, read_as
from .opened import Opened
from .protocols import Capabilities, Reader, Writer
from .safetensors.format import SAFETENSORS
from .structure import check_listed_state_dicts
from .torch_save.format import TORCH_SAVE, TORCH_SUFFIXES, torch_files

# each a Reader and a Writer, in precedence order; the folder kinds resolve to them (Megatron-Core
# before DCP: its iteration folder is a DCP folder with metadata.json and common.pt beside it)
FORMATS: tuple = (DEEPSPEED, DS_UNIVERSAL, MCORE, DCP, SAFETENSORS, TORCH_SAVE)

# the one ordered list a path is tried against: folder kinds first, then every format
ORDER: list[Kind] = [RunFolderKind(), TrainerKind(), LightningKind(DCP), AccelerateKind()]
ORDER += [FormatKind(fmt) for fmt in FORMATS]


def register(fmt: "Reader | Writer") -> "Reader | Writer":
    """Add a format (a Reader and a Writer, formats/protocols.py) after those registered: it is
    detected, opened, inspected, verified and written like them, by its name and capabilities."""
    global FORMATS
    if any(f.name == fmt.name for f in FORMATS):
        raise UnsupportedError(f"a format named {fmt.name!r} is already registered")
    FORMATS = (*FORMATS, fmt)
    ORDER.append(FormatKind(fmt))
    return fmt


def tag_for_step(path: str, source: Source, step: int) -> str:
    """--step N: the --tag naming the checkpoint of step N. A format whose reader takes tags and
    names them by step (its adapter's `tag_for_step`: Megatron's iter_%07d) answers for a folder
    it detects; else the run folder's entry (or a DeepSpeed tag global_stepN)."""
    for fmt in FORMATS:
        named = getattr(fmt, "tag_for_step", None)
        if named is not None and fmt.capabilities.tags and fmt.detect(source):
            tag = named(path, source, step)
            if tag is not None:
                return tag
    return run_folder.tag_for_step(path, source, step)


def format_named(name: str) -> "Reader | Writer":
    """The registered format of this name (an index's `format`); any other name is refused."""
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise UnsupportedError(
        f"no reader or writer for the format {name!r} (ckptkit has {', '.join(f.name for f in FORMATS)})"
    )


def format_of(index: CheckpointIndex) -> "Reader | Writer":
    """The registered format that read `index`."""
    return format_named(index.format)


def step_folder_name(name: str, step: int) -> str:
    """The folder format `name` saves training step `step` in by default (DeepSpeed: its tag)."""
    folders = format_named(name).capabilities.step_folders
    if folders is None:
        raise UnsupportedError(f"the format {name!r} names no step folders")
    return folders.name(step)


def is_step_folder(name: str) -> bool:
    """Whether `name` is the default folder of one training step's save in any registered format
    (DeepSpeed's tag in its save folder)."""
    return any(
        f.capabilities.step_folders is not None and f.capabilities.step_folders.step_of(name) is not None
        for f in FORMATS
    )


def capabilities_of(index: CheckpointIndex) -> Capabilities:
    """What the format of `index` can do (its writer's layouts, world sizes, optimizer state...)."""
    return format_of(index).capabilities


def detect(source: Source, name: str | None = None) -> list[str]:
    """What the registry's loop opens `source` (a folder; or its file `name`) as: [] when nothing
    recognises it, else the one format (or folder kind, a run folder) it is read as."""
    spot = Spot(source.root, source, name is None and source.isdir(""), name)
    kind = _first(spot, ORDER, wrapped=False)
    return [] if kind is None else [kind.format or kind.name]


def _first(spot: Spot, kinds: list[Kind], wrapped: bool = True) -> Kind | None:
    """The first of `kinds` that detects `spot` (`wrapped` False: the kinds that wrap another are
    passed over unasked: what they wrap is what is found)."""
    for kind in kinds:
        if (wrapped or not kind.wraps) and kind.detect(spot):
            return kind
    return None


def _parent_and_name(path: str) -> tuple[str, str]:
    path = path.rstrip("/")
    if is_url(path):
        parent, _, name = path.rpartition("/")
        return parent, name
    return os.path.dirname(os.path.abspath(path)), os.path.basename(path)


def open_checkpoint(
    path: str,
    expect: str | None = None,
    tag: str | None = None,
    follow_links: bool | None = None,
    *,
    optimizer: bool = True,
) -> Opened:
    """Detect the format at `path` and index it. `expect` asserts the format (e.g. "dcp");
    `tag` picks a DeepSpeed tag other than the one `latest` names; `follow_links` lets a local
    checkpoint's links lead outside it (default: refused unless CKPTKIT_FOLLOW_LINKS=1);
    `optimizer` False: the caller writes no optimizer state, so a ZeRO reader may count the
    optimizer's per-parameter entries instead of indexing them (consolidate)."""
    path = local_path(path)  # file:///abs/x.pt reads exactly as /abs/x.pt (its folder, its side files)
    with paused_collector():  # the index is millions of new objects and no garbage: nothing to collect
        return _open_checkpoint(path, expect, tag, follow_links, optimizer)


def _open_checkpoint(
    path: str, expect: str | None, tag: str | None, follow_links: bool | None, optimizer: bool = True
) -> Opened:
    source = open_source(path, follow_links)
    _refuse_unfinished(path, source)
    folder = source.isdir("")
    if folder:
        spot = Spot(path, source, True, None, tag, follow_links, optimizer, expect, open_checkpoint)
    else:
        parent, name = _parent_and_name(path)
        inside = open_source(parent, follow_links, only=name)
        spot = Spot(path, inside, False, name, tag, follow_links, optimizer, expect, open_checkpoint)
    return _open_from(spot, 0)


def _open_from(spot: Spot, start: int) -> Opened:
    """The loop: the first kind from ORDER[start] on that detects `spot` opens it (a kind that wraps
    another hands it on to the kinds after it); nothing detecting it, one refusal."""
    for i in range(start, len(ORDER)):
        kind = ORDER[i]
        if not kind.detect(spot):
            continue
        if spot.tag is not None and not kind.takes_tag:
            raise NotACheckpointError(f"{spot.path}: --tag is for DeepSpeed checkpoints, and this is not one")
        opened = kind.open(spot, lambda: _open_from(spot, i + 1))
        return opened if kind.finishes else _finish(opened, spot)
    return _finish(_unrecognised(spot), spot)


def _finish(opened: Opened, spot: Spot) -> Opened:
    """What every opened checkpoint gets: no state dict stored as a list, Lightning's marks, `expect`."""
    check_listed_state_dicts(opened.index, spot.path)
    lightning.annotate(opened.index)
    if spot.expect is not None and opened.index.format != spot.expect:
        raise NotACheckpointError(f"{spot.path}: is a {opened.index.format} checkpoint, expected {spot.expect}")
    return opened


def _refuse_unfinished(path: str, source: Source) -> None:
    """A remote output ckptkit did not finish (the commit marker never came) is not a checkpoint."""
    from ..storage.remote_output import COMPLETE, INCOMPLETE

    if source.isdir("") and source.exists(INCOMPLETE) and not source.exists(COMPLETE):
        raise NotACheckpointError(
            f"{path}: is an unfinished ckptkit output ({INCOMPLETE} is there and "
            f"{COMPLETE} is not): the run that wrote it failed or is still running"
        )


def _unrecognised(spot: Spot) -> Opened:
    """Nothing recognised `spot`: one sentence saying what was looked for and what was found. A
    file named as a format's own (`.safetensors`, `.pt`...) is handed to that format's reader, which
    says precisely what is wrong with it; a folder of a known kind's broken parts, the same."""
    path = spot.path
    if spot.tag is not None:
        raise NotACheckpointError(f"{path}: --tag is for DeepSpeed checkpoints, and this is not one")
    if not spot.folder:
        named = next((f for f in FORMATS if spot.name.endswith(f.capabilities.suffixes)), None)
        if named is not None:
            return read_as(named, spot)
        raise NotACheckpointError(
            f"{path}: not a checkpoint ckptkit recognises (not a torch.save archive nor a safetensors file)"
        )
    source, names = spot.source, spot.source.listdir("")
    local = accelerate.has_local_state_dict(source)
    if local:  # reading one explains (ShardedTensor flat parameters) in one sentence
        TORCH_SAVE.read_index(source, name=local[0])
    if any(n.endswith(".distcp") for n in names):
        raise NotACheckpointError(
            f"{path}: has .distcp data files but no .metadata: an incomplete DCP checkpoint (the save did not finish)"
        )
    raise NotACheckpointError(
        f"{path}: not a checkpoint ckptkit recognises; {_found(source, names, torch_files(source))}. "
        f"Recognised: a DCP checkpoint (.metadata), a DeepSpeed save (`latest` or ZeRO rank "
        f"files), *.safetensors, one torch.save file ({', '.join(TORCH_SUFFIXES)}), "
        f"accelerate's pytorch_model_fsdp_N/, or {run_folder.RECOGNISED}"
    )


def _found(source: Source, names: list[str], torch_files: list[str]) -> str:
    """What an unrecognised folder holds, in a few words (folders marked with a trailing /)."""
    if not names:
        return "the folder is empty"
    if len(torch_files) > 1:  # several: which one is meant cannot be guessed
        shown = ", ".join(torch_files[:8]) + (", ..." if len(torch_files) > 8 else "")
        return f"found {len(torch_files)} torch.save files ({shown}): name the one to read"
    marked = [n + "/" if source.isdir(n) else n for n in names[:8]]
    shown = ", ".join(name_of(n) for n in marked) + (", ..." if len(names) > 8 else "")
    return f"found {len(names)} entries ({shown})"
