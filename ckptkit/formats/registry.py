"""The one registry of formats: find a checkpoint's format from its path, build its index, and
answer what a format can do.

Every command takes a path (a folder or a file) and lands here. Detection is by content
(DCP's .metadata, safetensors headers, torch.save's zip magic), never by trust in a name alone;
a path nothing recognises gets one sentence saying what was looked for and what was found.

The formats are Reader/Writer adapters (each format package's format.py, the contract in protocols.py),
registered in FORMATS with their capabilities. Operations ask `capabilities_of(index)` or
`format_of(index)`, never compare format names. The folder kinds around them (run folders,
accelerate's subfolders, HF Trainer and Lightning folders) are resolvers here: each finds one of
the registered formats inside a folder.
"""

from __future__ import annotations

import os

from ..errors import NotACheckpointError, UnsupportedError, name_of
from ..index.types import CheckpointIndex
from ..storage.source import Source, is_url, local_path, open_source
from . import accelerate, lightning, run_folder, trainer
from .dcp.format import DCP
from .deepspeed.format import DEEPSPEED
from .deepspeed import files as ds_files
from .opened import Opened
from .protocols import Capabilities, Reader, Writer
from .safetensors import reader as st_reader
from .safetensors.format import SAFETENSORS, looks_like_safetensors
from .torch_save.format import TORCH_SAVE, TORCH_SUFFIXES, torch_files
from .torch_save.reader import check_listed_state_dicts
from ..runner.heap import paused_collector
from ..runner.torch_archive import ZIP_MAGIC

FORMATS: tuple = (DEEPSPEED, DCP, SAFETENSORS, TORCH_SAVE)  # each a Reader and a Writer; folder kinds resolve to them


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


def capabilities_of(index: CheckpointIndex) -> Capabilities:
    """What the format of `index` can do (its writer's layouts, world sizes, optimizer state...)."""
    return format_of(index).capabilities


def detect(source: Source, name: str | None = None) -> list[str]:
    """The names of the formats whose reader recognises `source` (or its file `name`)."""
    return [fmt.name for fmt in FORMATS if fmt.detect(source, name)]


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
    run = run_folder.resolve(path, source, open_checkpoint, tag, follow_links) if source.isdir("") else None
    if run is not None:  # a training output folder: its newest complete checkpoint (or the one --tag names)
        opened = (
            run.opened
            if run.opened is not None and expect is None  # read whole while choosing
            else open_checkpoint(run.path, expect, run.tag, follow_links, optimizer=optimizer)
        )
        run.opened = None
        opened.run = run
        if opened.index.step is None:
            opened.index.step = run.step
        run_folder.announce(run)
        return opened
    tag_folder = (
        tag is not None
        and source.isdir("")
        and source.isdir(tag)
        and ds_files.looks_like_tag_folder(source.listdir(tag))
    )
    if tag is not None and not (source.isdir("") and ds_files.detect(source) or tag_folder):
        raise NotACheckpointError(f"{path}: --tag is for DeepSpeed checkpoints, and this is not one")
    if source.isdir("") and (ds_files.detect(source) or tag_folder):
        opened = Opened(source, DEEPSPEED.read_index(source, tag=tag, optimizer=optimizer), path)
    elif source.isdir(""):
        opened = _open_folder(path, source)
    else:
        opened = _open_file(path, follow_links)
    check_listed_state_dicts(opened.index, path)
    lightning.annotate(opened.index)
    if expect is not None and opened.index.format != expect:
        raise NotACheckpointError(f"{path}: is a {opened.index.format} checkpoint, expected {expect}")
    if opened.source is source:
        _note_trainer(opened, tag)
    return opened


def _note_trainer(opened: Opened, tag: str | None) -> None:
    """An HF Trainer folder: its parts and side files, and the step trainer_state.json records."""
    folder = trainer.describe(opened.source, tag)
    if folder is None:
        return
    opened.trainer = folder
    opened.index.metadata["hf_trainer"] = folder.as_json()
    if folder.step is not None:
        opened.index.step = folder.step


def _refuse_unfinished(path: str, source: Source) -> None:
    """A remote output ckptkit did not finish (the commit marker never came) is not a checkpoint."""
    from ..storage.remote_output import COMPLETE, INCOMPLETE

    if source.isdir("") and source.exists(INCOMPLETE) and not source.exists(COMPLETE):
        raise NotACheckpointError(
            f"{path}: is an unfinished ckptkit output ({INCOMPLETE} is there and "
            f"{COMPLETE} is not): the run that wrote it failed or is still running"
        )


def _open_file(path: str, follow_links: bool | None) -> Opened:
    parent, name = _parent_and_name(path)
    source = open_source(parent, follow_links, only=name)
    head = source.read(name, 0, min(8, source.size(name)))
    if head[:4] == ZIP_MAGIC:
        index = TORCH_SAVE.read_index(source, name=name)
    elif name.endswith(".safetensors") or looks_like_safetensors(source, name):
        index = SAFETENSORS.read_index(source, name=name)
    elif name.endswith(TORCH_SUFFIXES):
        index = TORCH_SAVE.read_index(source, name=name)  # raises a precise error (legacy / damaged)
    else:
        raise NotACheckpointError(
            f"{path}: not a checkpoint ckptkit recognises (not a torch.save archive nor a safetensors file)"
        )
    index.root = path
    return Opened(source, index, path)


def _open_folder(path: str, source: Source) -> Opened:
    names = source.listdir("")
    if DCP.detect(source):
        index = DCP.read_index(source)
        lightning.add_meta(source, index)  # Lightning's FSDP sharded checkpoint: meta.pt beside the DCP files
        return Opened(source, index, path)
    subdirs = accelerate.parts(source)
    if subdirs:
        return Opened(source, accelerate.read_index(source, subdirs), path)
    local = accelerate.has_local_state_dict(source)
    if local:  # reading one explains (ShardedTensor flat parameters) in one sentence
        TORCH_SAVE.read_index(source, name=local[0])
    if any(n.endswith(".distcp") for n in names):
        raise NotACheckpointError(
            f"{path}: has .distcp data files but no .metadata: an incomplete DCP checkpoint (the save did not finish)"
        )
    if st_reader.safetensors_files(source):
        return Opened(source, SAFETENSORS.read_index(source), path)
    found = torch_files(source)
    if len(found) == 1:
        return Opened(source, TORCH_SAVE.read_index(source), path)
    raise NotACheckpointError(
        f"{path}: not a checkpoint ckptkit recognises; {_found(source, names, found)}. "
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
