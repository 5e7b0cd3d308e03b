"""`ckptkit consolidate`: any checkpoint -> Hugging Face style safetensors of the model.

OUT is a folder (model.safetensors, or shards with their index), or the file itself when it ends
in .safetensors and the model fits in one shard. Keys are the model's own state_dict keys (the
"model" container of {"model":..,"optim":..} checkpoints is dropped). Optimizer state only on
request, in separate optimizer*.safetensors files. Streams slab by slab: memory is bounded by the budget, not the
checkpoint.
"""

from __future__ import annotations

import dataclasses

from collections import ChainMap
from dataclasses import dataclass, field

from .. import knobs
from ..convert.names import KeyRules
from ..errors import UnsupportedError, UsageError
from ..formats.protocols import UNINDEXED_OPTIMIZER, OutTensor, SafetensorsTarget
from ..formats.registry import format_named, open_checkpoint
from ..index.dtypes import is_floating
from ..index.serialize import safe_value
from ..runner.fetch import Fetcher
from ..runner.heap import frozen_heap
from ..runner.stream import find_aliases
from ..storage.output import open_output
from .outputs import file_output, single_file_shards
from ..convert.keys import split_roles
from ..context import RunContext, context_of
from . import side_files


@dataclass
class ConsolidateResult:
    out: str
    source_format: str
    model_tensors: int
    model_bytes: int
    files: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    optimizer_tensors: int = 0
    skipped: list[str] = field(default_factory=list)
    side_files: list[str] = field(default_factory=list)  # config/tokenizer files copied beside the model
    side_notes: list[str] = field(default_factory=list)  # where they came from, or what from_pretrained lacks
    not_written: list[str] = field(default_factory=list)  # what was read and left out, and how to keep it
    notes: list[str] = field(default_factory=list)  # how names were made (a default prefix stripped...)


def consolidate(
    src: str,
    out: str,
    dtype: str | None = None,
    max_shard_size: str | int = knobs.MAX_SHARD_SIZE,
    include_optimizer: bool = False,
    options: RunContext | None = None,
    tag: str | None = None,
    rules: KeyRules | None = None,
    config: str | None = None,
    *,
    ctx: RunContext | None = None,
) -> ConsolidateResult:
    """`rules`: --strip-prefix/--rename (convert's KeyRules); `config`: --config DIR, the folder
    whose config.json and tokenizer files are copied instead of those found beside the source."""
    ctx = context_of(ctx, options)
    # without --include-optimizer no optimizer state is written: a ZeRO reader then only counts its entries
    opened = open_checkpoint(src, tag=tag, follow_links=ctx.follow_links, optimizer=include_optimizer)
    opened, training_notes = _training_view(opened, include_optimizer)
    # the index out of the collector's sight from here to the end of the write (runner/heap): naming,
    # planning and writing make many objects, and a full collection would traverse the index each time
    with frozen_heap():
        index = opened.index
        split = split_roles(index)
        if not split.model:
            raise UsageError(
                f"{src}: found no model tensors to consolidate "
                f"({len(index.tensors)} tensors, none under a model container)"
            )
        tensors, view_notes = _model_view(index, split, include_optimizer)
        names = _rename(split, index, key_rules(index, rules), src)
        max_bytes = knobs.parse_size(max_shard_size, "--max-shard-size")
        model, aliases = _model_tensors(index, tensors, split, dtype)
        optim = (
            [OutTensor(name, index.tensors[key], index.tensors[key].dtype) for name, key in split.optim.items()]
            if include_optimizer
            else []
        )
        single = file_output(out, "safetensors")
        if single:
            _check_single_file(out, model, max_bytes, include_optimizer, config)
        sides = None if single else _side_files(opened.path, config, ctx)
        ctx.progress.start(sum(t.nbytes for t in model + optim), "consolidate")
        fetcher, writer = Fetcher(opened.source, index=index), format_named("safetensors")
        sources = (src, *(sides.paths() if sides is not None else ()))  # the side files copied are sources too
        with open_output(out, overwrite=ctx.overwrite, group=ctx.group, sources=sources, single_file=single) as target:
            basename = target.name[: -len(".safetensors")] if single else "model"
            files = writer.write(SafetensorsTarget(fetcher, model, max_bytes, basename, aliases), target, ctx)
            if optim:
                objects = {
                    name: _param_list(name, safe_value(split.optim_values.get(name, index.objects[key].data)), names)
                    for name, key in split.optim_objects.items()
                }
                optimizer = SafetensorsTarget(fetcher, optim, max_bytes, "optimizer", objects=objects)
                files += writer.write(optimizer, target, ctx)
            if sides is not None:
                try:
                    side_files.copy(sides, target)
                finally:
                    sides.close()
        ctx.progress.close()
        result = _result(out, index, split, model, aliases, optim, files, sides, rules, include_optimizer)
        result.notes += training_notes + view_notes
        return result


def _training_view(opened, include_optimizer: bool):
    """With --include-optimizer, the format's training-state view where it has one (MCore: its
    optimizer state named per layer, as its model is), and the view's notes."""
    if not include_optimizer:
        return opened, []
    try:
        view = getattr(format_named(opened.index.format), "training_index", None)
    except UnsupportedError:  # an index of a format ckptkit writes but does not register as read
        view = None
    if view is None:
        return opened, []
    index, notes = view(opened.index, True, "consolidate without --include-optimizer (the model alone)", opened.path)
    return dataclasses.replace(opened, index=index), notes


def _model_view(index, split, include_optimizer: bool) -> tuple[dict, list[str]]:
    """The tensors by key, with those a format's own model view adds: a format that stores its model
    otherwise than its state_dict() names it (MCore's stacked layers) has `consolidated_model`,
    which renames split.model and gives the entries of the new keys; and notes on what it did."""
    try:
        view = getattr(format_named(index.format), "consolidated_model", None)
    except UnsupportedError:  # an index of a format ckptkit writes but does not register as read
        view = None
    if view is None:
        return index.tensors, []
    split.model, made, notes = view(index, split.model, include_optimizer)
    return ChainMap(made, index.tensors), notes


def _model_tensors(index, tensors, split, dtype: str | None) -> tuple[list[OutTensor], dict[str, str]]:
    """The model tensors to write (a tied one once) in their output dtype, and the tied names."""
    # DeepSpeed: fp32 masters, with frozen params and buffers upcast as zero_to_fp32 does
    default = dtype or index.metadata.get("consolidate_dtype")

    def out_dtype(key: str) -> str:
        src_dtype = tensors[key].dtype
        return default if default and is_floating(src_dtype) else src_dtype

    aliases = find_aliases({name: tensors[key] for name, key in split.model.items()})
    model = [OutTensor(name, tensors[key], out_dtype(key)) for name, key in split.model.items() if name not in aliases]
    return model, aliases


def _side_files(path: str, config: str | None, ctx: RunContext) -> side_files.SideFiles:
    """The config/tokenizer files to copy beside the model: from --config DIR, or found around the source."""
    return (
        side_files.from_config_dir(config, ctx.follow_links)
        if config is not None
        else side_files.find(path, ctx.follow_links)
    )


def _check_single_file(
    out: str, model: list[OutTensor], max_bytes: int, include_optimizer: bool, config: str | None
) -> None:
    """A .safetensors OUT holds the model alone, in one shard."""
    if include_optimizer:
        raise UsageError(
            f"{out}: --include-optimizer writes optimizer*.safetensors beside the model, so "
            f"OUT must be a folder, not a .safetensors file"
        )
    if config is not None:
        raise UsageError(
            f"{out}: --config copies config.json beside the model, so OUT must be a folder, not a .safetensors file"
        )
    single_file_shards(out, model, max_bytes, " (or a larger --max-shard-size)")


def _result(
    out: str,
    index,
    split,
    model: list[OutTensor],
    aliases: dict[str, str],
    optim: list[OutTensor],
    files: list[str],
    sides,
    rules: KeyRules | None,
    include_optimizer: bool,
) -> ConsolidateResult:
    """What was written, and every note on what was not or how it was named."""
    result = ConsolidateResult(
        out, index.format, len(split.model), sum(t.nbytes for t in model), files, aliases, len(optim), list(split.other)
    )
    result.not_written = _not_written(index, split, include_optimizer)
    result.notes = _name_notes(index, split, rules, include_optimizer)
    if sides is not None:
        result.side_files, result.side_notes = sides.names(), side_files.summary(sides)
    else:
        result.side_notes = [
            f"OUT is a single file: no {side_files.CONFIG} beside it; transformers' "
            f"from_pretrained needs a folder (consolidate into a folder to get one)"
        ]
    return result


# Set by a format that cannot write its optimizer state beside the model: what to say instead of
# "add --include-optimizer" where the optimizer state left out is counted.
OPTIMIZER_HINT = "consolidate_optimizer_hint"


# The reader's own default name rules, used when the user gives none: a list of prefixes a format
# reader knows every model name carries and the model's own names lack (formats/lightning.py sets
# it to Lightning's `model.` attribute prefix). Explicit --strip-prefix/--rename replace it.
DEFAULT_STRIP_KEY = "default_strip_prefixes"


def key_rules(index, rules: KeyRules | None) -> KeyRules | None:
    """The rules to apply to output names: the user's when given, else the reader's default
    (index.metadata[DEFAULT_STRIP_KEY]); None leaves names exactly as the checkpoint has them."""
    if rules is not None and (rules.strip or rules.renames or rules.add):
        return rules
    default = index.metadata.get(DEFAULT_STRIP_KEY)
    return KeyRules(strip=tuple(default)) if default else None


def _rename(split, index, rules: KeyRules | None, src: str) -> KeyRules | None:
    """Apply `rules` to the model names, and to the parameter names inside optimizer state names
    (`state.<name>.<key>`, and each param_groups' `params` list), as convert does."""
    if rules is None:
        return None
    rules = rules.for_names(list(split.model))
    renamed: dict[str, str] = {}
    for name, key in split.model.items():
        new = rules.apply(name)
        if new in renamed:
            raise UsageError(
                f"{src}: the name rules map two model tensors to the same name {new!r} ({renamed[new]} and {key})"
            )
        if not new:
            raise UsageError(f"{src}: the name rules leave model tensor {key} without a name")
        renamed[new] = key
    split.model = renamed

    def param_name(name: str) -> str:
        if name in split.optim_params:  # (optimizer slot prefix, parameter, state key); numbers stay numbers
            prefix, param, statekey = split.optim_params[name]
            return f"{prefix}state.{param if param.isdigit() else rules.apply(param)}.{statekey}"
        return name

    split.optim = {param_name(n): k for n, k in split.optim.items()}
    split.optim_objects = {param_name(n): k for n, k in split.optim_objects.items()}
    return rules


def _param_list(name: str, value, rules: KeyRules | None):
    """A param group's `params` (parameter names) under the same rules as the model names."""
    if rules is not None and name.endswith(".params") and isinstance(value, list):
        return [rules.apply(v) if isinstance(v, str) else v for v in value]
    return value


def _name_notes(index, split, rules: KeyRules | None, include_optimizer: bool) -> list[str]:
    """Names not as the checkpoint has them, or not named at all, said once each."""
    notes = []
    default = index.metadata.get(DEFAULT_STRIP_KEY)
    if default and key_rules(index, rules) is not None and key_rules(index, rules).strip == tuple(default):
        notes.append(
            f"names: stripped {', '.join(default)} from every model name (the LightningModule attribute "
            f"holding the network), so they are the network's own; --strip-prefix or --rename replace this"
        )
    if include_optimizer:
        notes += [f"optimizer names: {why}; kept by parameter number" for why in split.numbered.values()]
        notes += [
            f"optimizer names: {slot}'s parameter numbers named from the model's order (one param group "
            f"holding every model tensor, every state shaped like its tensor)"
            for slot in split.named_by_order
        ]
    return notes


def _not_written(index, split, include_optimizer: bool) -> list[str]:
    """What consolidate read and, writing the model by design, left out: never a silent loss."""
    notes = []
    unindexed = index.metadata.get(UNINDEXED_OPTIMIZER, {})  # counted by the reader, not indexed
    tensors = len(split.optim) + unindexed.get("tensors", 0)
    values = len(split.optim_objects) + unindexed.get("values", 0)
    if not include_optimizer and (tensors or values):
        how = index.metadata.get(OPTIMIZER_HINT, "add --include-optimizer")
        notes.append(f"not written: {tensors} optimizer tensors and {values} optimizer values ({how})")
    optim_keys = set(split.optim_objects.values())
    other = [k for k in index.objects if k not in optim_keys]
    if other:
        shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
        notes.append(
            f"not written: {len(other)} other values ({shown}); consolidate writes weights, "
            f"convert --to torch or dcp keeps them"
        )
    notes += [f"not read: {why}" for why in index.metadata.get("unread", {}).values()]  # e.g. Lightning's meta.pt
    return notes
