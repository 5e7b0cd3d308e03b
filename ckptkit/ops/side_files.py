"""The files beside a checkpoint that `from_pretrained` needs: config, generation config, tokenizer.

A consolidated model loads with transformers only when its folder also holds `config.json` (and,
to be useful, the tokenizer). Trainers leave these files in the checkpoint folder, in the trainer
folder around it (`checkpoint-N/` around `global_stepN/` or `pytorch_model_fsdp_0/`), or in the
run folder above (the HF `output_dir`, where `save_model` writes them). They are found there,
nearest first, and copied byte for byte through ckptkit's storage layer: each folder is read
inside its own boundary (storage/paths.py), so a link leading out is refused as for any
checkpoint file, and nothing is parsed but config.json (checked to be a JSON object, within the
memory budget). The files copied are sources like the checkpoint: an OUT that is one of them, or
holds one, is refused (`paths()` goes to the output's overlap check).
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field

from ..errors import CkptkitError, UsageError
from ..formats.registry import is_step_folder
from ..storage.paths import kind_of
from ..storage.source import Source, is_url, open_source

CONFIG = "config.json"
# transformers' names (utils/__init__.py, utils/hub.py, tokenization_utils_base.py, the tokenizers' VOCAB_FILES_NAMES)
NAMES = (
    CONFIG,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
PATTERNS = ("configuration_*.py", "modeling_*.py", "tokenization_*.py")  # trust_remote_code models (auto_map)
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # transformers 4.5x+: extra templates as *.jinja
CHUNK = 4 << 20

# A checkpoint that is a part of a trainer's folder: its parent is that folder (a DeepSpeed tag,
# registry.is_step_folder; accelerate's FSDP sub-folders).
TRAINER_PARTS = re.compile(r"^(pytorch_model_fsdp_\d+|optimizer_\d+)$")
# A checkpoint that is one entry of a run folder: its parent is the run folder (HF output_dir,
# Checkpointer directory, DeepSpeed save folder: a step folder, Lightning checkpoints/).
RUN_ENTRIES = re.compile(r"^(checkpoint-\d+|step_\d+|.*step=\d+.*\.ckpt)$")


@dataclass(frozen=True)
class SideFile:
    name: str  # its name in OUT (and in the folder it came from), e.g. "tokenizer.json"
    folder: str  # the folder it was found in


@dataclass
class SideFiles:
    """What would be copied, and from where; `looked_in` lists every folder searched, nearest first."""

    files: list[SideFile] = field(default_factory=list)
    looked_in: list[str] = field(default_factory=list)
    explicit: bool = False  # from --config DIR
    sources: dict[str, Source] = field(default_factory=dict, repr=False)

    @property
    def has_config(self) -> bool:
        return any(f.name == CONFIG for f in self.files)

    def names(self) -> list[str]:
        return [f.name for f in self.files]

    def paths(self) -> list[str]:
        """Every file that would be copied, as a path: sources an output must keep apart from."""
        return [f"{f.folder.rstrip('/')}/{f.name}" for f in self.files]

    def close(self) -> None:
        for source in self.sources.values():
            closer = getattr(source, "close", None)
            if closer is not None:
                closer()
        self.sources.clear()


def _parent(path: str) -> str:
    path = path.rstrip("/")
    if is_url(path):
        return path.rpartition("/")[0]
    return os.path.dirname(os.path.abspath(path))


def _base(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2] if is_url(path) else os.path.basename(os.path.abspath(path))


def homes(checkpoint: str, follow_links: bool | None = None) -> list[str]:
    """The folders that may hold a checkpoint's side files, nearest first: the checkpoint folder
    (a single file's own folder), its trainer folder, and its run folder."""
    is_dir = open_source(checkpoint, follow_links).isdir("") if is_url(checkpoint) else os.path.isdir(checkpoint)
    here = checkpoint.rstrip("/") if is_dir else _parent(checkpoint)
    found = [here]
    if TRAINER_PARTS.match(_base(here)) or is_step_folder(_base(here)):
        here = _parent(here)
        found.append(here)
    if RUN_ENTRIES.match(_base(here)) or is_step_folder(_base(here)):
        found.append(_parent(here))
    return [f for i, f in enumerate(found) if f and f not in found[:i]]


def _wanted(source: Source) -> list[str]:
    """The side-file names in a folder (regular files only are read later; folders are skipped)."""
    names = source.listdir("")
    picked = [
        n for n in names if (n in NAMES or any(fnmatch.fnmatchcase(n, p) for p in PATTERNS)) and not source.isdir(n)
    ]
    if CHAT_TEMPLATE_DIR in names and source.isdir(CHAT_TEMPLATE_DIR):
        picked += [
            f"{CHAT_TEMPLATE_DIR}/{n}"
            for n in source.listdir(CHAT_TEMPLATE_DIR)
            if n.endswith(".jinja") and not source.isdir(f"{CHAT_TEMPLATE_DIR}/{n}")
        ]
    return picked


def find(checkpoint: str, follow_links: bool | None = None) -> SideFiles:
    """The side files of `checkpoint` (the path of the checkpoint actually read), nearest folder
    first for each name. A folder that cannot be listed above the checkpoint is passed over."""
    found = SideFiles()
    for i, folder in enumerate(homes(checkpoint, follow_links)):
        try:  # a folder above that cannot be listed (permissions...) is passed over
            source = open_source(folder, follow_links)
            source.listdir("")
        except CkptkitError:
            if i == 0:
                raise
            continue
        except OSError:
            continue
        names = _wanted(source)  # a bad entry (a chat template folder linked out...) is one sentence
        found.looked_in.append(folder)
        taken = set(found.names())
        new = [n for n in names if n not in taken]
        if new:
            found.sources[folder] = source
            found.files += [SideFile(n, folder) for n in new]
    _check(found)
    return found


def from_config_dir(config: str, follow_links: bool | None = None) -> SideFiles:
    """--config DIR: the side files of DIR instead of the checkpoint's (DIR must hold config.json);
    a path to a config.json file takes that file alone."""
    if not is_url(config) and os.path.exists(config) and not (os.path.isfile(config) or os.path.isdir(config)):
        raise UsageError(
            f"--config {config}: is {kind_of(os.stat(config).st_mode)}, expected a folder holding "
            f"{CONFIG} (or {CONFIG} itself)"
        )
    if not is_url(config) and os.path.isfile(config):
        if _base(config) != CONFIG:
            raise UsageError(f"--config {config}: expected a folder holding config.json (or config.json itself)")
        folder = _parent(config)
        source = open_source(folder, follow_links, only=CONFIG)
        found = SideFiles([SideFile(CONFIG, folder)], [folder], True, {folder: source})
    else:
        if not is_url(config) and not os.path.isdir(config):
            raise UsageError(f"--config {config}: no such folder")
        source = open_source(config, follow_links)
        names = _wanted(source)
        found = SideFiles([SideFile(n, config) for n in names], [config], True, {config: source} if names else {})
        if not found.has_config:
            shown = ", ".join(names) if names else "no config or tokenizer files"
            raise UsageError(
                f"--config {config}: has no {CONFIG} (found {shown}); pass the folder of the "
                f"model's Hugging Face config"
            )
    _check(found)
    return found


def _check(found: SideFiles) -> None:
    """Every side file is a regular file that may be read (checked now, before any output is
    written), and config.json a JSON object, or from_pretrained fails later on the output."""
    from ..convert.hf_ties import model_config

    for f in found.files:
        found.sources[f.folder].size(f.name)  # missing, a FIFO, a link leading out: one sentence
        if f.name == CONFIG:
            model_config(found.sources[f.folder])


def copy(found: SideFiles, target) -> list[str]:
    """Copy every side file byte for byte into `target` (a storage.commit.Output), in chunks;
    in a distributed job rank 0 alone writes. Returns the names written."""
    if getattr(getattr(target, "group", None), "is_root", True):
        for f in found.files:
            source = found.sources[f.folder]
            size = source.size(f.name)
            with target.open(f.name) as out:
                done = 0
                while done < size:
                    chunk = source.read(f.name, done, min(CHUNK, size - done))
                    out.write(chunk)
                    done += len(chunk)
    return found.names()


def summary(found: SideFiles) -> list[str]:
    """Lines for a command's summary: what was copied from where, or what from_pretrained lacks."""
    lines = []
    by_folder: dict[str, list[str]] = {}
    for f in found.files:
        by_folder.setdefault(f.folder, []).append(f.name)
    for folder, names in by_folder.items():
        lines.append(f"copied from {folder}: {', '.join(names)}")
    if not found.has_config:
        lines.append(needs_config_note(found.looked_in))
    return lines


def needs_config_note(looked_in: list[str] | None = None) -> str:
    where = f" (none in {', '.join(looked_in)})" if looked_in else ""
    return (
        f"no {CONFIG} written{where}: transformers' from_pretrained(OUT) will need one; pass "
        f"--config DIR (a folder holding the model's config.json, e.g. a Hugging Face model folder) "
        f"or copy config.json into OUT"
    )
