"""Index a Megatron-Core distributed checkpoint (`dist_checkpointing.save`, torch_dist backend).

An iteration folder (`iter_0000002/`) is a DCP folder (read by the DCP reader: MCore's
`.metadata` also keeps its save plans, `Metadata.all_local_plans`, which the restricted loader
rebuilds as data) plus `metadata.json` (`"sharded_backend": "torch_dist"`, how it is recognised)
and `common.pt`, a torch.save of what every rank holds alike: Megatron-LM's `args`, the
`iteration`, the optimizer's param groups. Megatron-LM's save root holds iteration folders and
`latest_checkpointed_iteration.txt`, which names the newest (`iter_%07d`, or `release`).

Each tensor's role comes from its key (names.py) and is recorded as its path, so the model, the
optimizer state of each parameter and the distributed optimizer's flat buffers are told apart
the way every other format's are.
"""

from __future__ import annotations

import dataclasses
import re

from ... import safe_json
from ...errors import FormatError, NotACheckpointError, UsageError, name_of
from ...index.types import CheckpointIndex, CheckTable
from ...storage.source import Source
from ..accelerate import SubSource
from ..dcp import reader as dcp_reader
from ..torch_save import reader as ts_reader
from . import legacy, legacy_join
from .args import MegatronArgs, megatron_args
from .names import role_of

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
LATEST = "latest_checkpointed_iteration.txt"
ITERATION_DIR = re.compile(r"iter_[0-9]{7}|release")
MAX_SMALL_FILE = 1 << 20  # metadata.json, latest_checkpointed_iteration.txt


def _small_text(source: Source, rel: str) -> str | None:
    if not source.exists(rel) or source.isdir(rel):
        return None
    size = source.size(rel)
    if size > MAX_SMALL_FILE:
        return None
    try:
        return source.read(rel, 0, size).decode("utf-8")
    except UnicodeDecodeError:
        return None


def is_iteration(source: Source) -> bool:
    """A torch_dist iteration folder: metadata.json says so, and a DCP .metadata is there."""
    text = _small_text(source, METADATA_JSON)
    if text is None:
        return False
    try:
        meta = safe_json.loads(text, METADATA_JSON)
    except FormatError:
        return False
    return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist" and dcp_reader.detect(source)


def latest_entry(source: Source) -> str | None:
    """The iteration folder latest_checkpointed_iteration.txt names (`iter_0000002`, `release`), or
    None when there is no such file. A file that names no iteration is refused."""
    text = _small_text(source, LATEST)
    if text is None:
        return None
    value = text.strip()
    if value == "release":
        return value
    if not value.isascii() or not value.isdigit():
        raise FormatError(
            f"{source.label(LATEST)}: expected an iteration number or 'release', found {name_of(value[:40])}"
        )
    return f"iter_{int(value):07d}"


def read_index(source: Source, tag: str | None = None) -> CheckpointIndex:
    """The index of an iteration folder, or of the iteration a save root names (`tag`: another)."""
    if is_iteration(source):
        if tag is not None:
            raise UsageError(f"{source.root}: is one iteration folder; --tag/--step pick one in a save root")
        return read_iteration(source)
    folders = legacy.rank_folders(source)
    if folders:
        return legacy_join.read_joined(source, folders)
    entry = tag if tag is not None else latest_entry(source)
    if entry is None or not ITERATION_DIR.fullmatch(entry):
        raise UsageError(f"{source.root}: {name_of(entry or '')} is not an iteration folder name (iter_NNNNNNN)")
    if not source.isdir(entry):
        held = sorted(n for n in source.listdir("") if ITERATION_DIR.fullmatch(n))
        raise NotACheckpointError(
            f"{source.label(entry)}: the iteration {'asked for' if tag else f'{LATEST} names'} is not there "
            f"(iterations: {', '.join(held) or 'none'})"
        )
    inner = SubSource(source, entry)
    if is_iteration(inner):
        return _moved(read_iteration(inner), entry, source.root)
    folders = legacy.rank_folders(inner)
    if folders:
        return _moved(legacy_join.read_joined(inner, folders), entry, source.root)
    raise NotACheckpointError(
        f"{inner.root}: holds neither a torch_dist checkpoint ({METADATA_JSON} with sharded_backend "
        f"torch_dist, .metadata) nor legacy mp_rank_* folders"
    )


def iterations(source: Source) -> list[str]:
    """The iteration folders of a save root, oldest first."""
    return sorted(n for n in source.listdir("") if ITERATION_DIR.fullmatch(n) and source.isdir(n))


def read_iteration(source: Source) -> CheckpointIndex:
    index = dcp_reader.read_index(source)
    index.format = "mcore"
    for entry in index.tensors.values():  # (the sharded items: common.pt's keep their own nesting)
        entry.path = role_of(entry.key).path
    for entry in index.objects.values():
        role = role_of(entry.key)
        if role.kind != "model":
            entry.path = role.path
    args = _add_common(index, source)
    _describe(index, args, tensor_counts(index))
    return index


def tensor_counts(index: CheckpointIndex) -> dict[str, int]:
    """Every tensor counted once, by the head of its path, as inspect's summary counts them (common.pt's
    included): "model", "optimizer" (all of it), and within it "per_param" (a parameter's state),
    "flat_buffer" (the distributed optimizer's buffers) and "shared" (held for all parameters alike,
    such as Adam's `optimizer.state.common_step`)."""
    counts = {"model": 0, "optimizer": 0, "per_param": 0, "flat_buffer": 0, "shared": 0}
    for entry in index.tensors.values():
        path = tuple(entry.path or (entry.key,))
        if path[0] != "optimizer":
            counts["model"] += 1
            continue
        counts["optimizer"] += 1
        if len(path) == 4 and path[1] == "state":
            counts["per_param"] += 1
        elif len(path) == 3 and path[1] == "distributed":
            counts["flat_buffer"] += 1
        else:
            counts["shared"] += 1
    return counts


def _add_common(index: CheckpointIndex, source: Source) -> MegatronArgs | None:
    """common.pt's values (restricted loader; `args` as data), beside the DCP items."""
    if not source.exists(COMMON):
        index.metadata.setdefault("unread", {})[COMMON] = f"{COMMON} is missing: no args, iteration or param groups"
        return None
    common = ts_reader.read_index(source, COMMON)
    index.files.update(common.files)
    index.checks.extend(common.checks)
    for entry in common.tensors.values():
        index.add_tensor(entry)
    for entry in common.objects.values():
        index.add_object(entry)
    iteration = common.objects.get("iteration")
    if iteration is not None and type(iteration.value) is int:
        index.step = iteration.value
    args = common.objects.get("args")
    return megatron_args(args.value) if args is not None else None


def _describe(index: CheckpointIndex, args: MegatronArgs | None, counts: dict[str, int]) -> None:
    notes = index.metadata.setdefault("notes", [])
    if args is not None:
        index.metadata["parallel"] = {
            axis: size for axis, size in (("tp", args.tp), ("pp", args.pp), ("ep", args.ep), ("dp", args.dp)) if size
        }
        index.metadata["megatron_args"] = args.as_json()
        if args.world_size:
            index.world_size = args.world_size
    notes.append(
        f"Megatron-Core torch_dist checkpoint: {counts['model']} model tensors, {counts['optimizer']} optimizer "
        f"({_optimizer_parts(counts)})"
        + (f"; layers {args.num_layers}, output layer tied to the embedding: {_yes(args.tied)}" if args else "")
    )
    if counts["flat_buffer"]:
        notes.append(
            f"{counts['flat_buffer']} optimizer tensors are the distributed optimizer's flat buffers "
            f"(dp_reshardable: MCore's grad-buffer layout, not mapped to parameters); save with "
            f"--dist-ckpt-optim-fully-reshardable to have them per parameter"
        )


def _optimizer_parts(counts: dict[str, int]) -> str:
    parts = [
        f"{counts[kind]} {what}"
        for kind, what in (
            ("per_param", "per-parameter state"),
            ("flat_buffer", "flat buffers"),
            ("shared", "shared by all parameters"),
        )
        if counts[kind]
    ]
    return ", ".join(parts) or "none"


def _yes(value: bool | None) -> str:
    return "unknown" if value is None else "yes" if value else "no"


def _moved(index: CheckpointIndex, sub: str, root: str) -> CheckpointIndex:
    """An iteration's index with its files named from the save root (where it is read from)."""
    prefix = sub + "/"

    def moved(loc):
        return dataclasses.replace(loc, file=prefix + loc.file) if loc is not None else None

    for entry in index.tensors.values():
        entry.pieces = [dataclasses.replace(p, location=moved(p.location)) for p in entry.pieces]
    for entry in index.objects.values():
        entry.location = moved(entry.location)
    index.files = {prefix + k: v for k, v in index.files.items()}
    index.checks = CheckTable(c._replace(file=prefix + c.file) for c in index.checks)
    index.root = root
    index.metadata["iteration_folder"] = sub
    return index
