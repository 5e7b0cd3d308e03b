"""`ckptkit convert`: a training checkpoint of one backend as another, optimizer state included.

Source (any format ckptkit reads) -> canonical training state (convert/state.py) -> target
(the names `--to` and `--from` share are in ckptkit/convert/__init__.py):
  dcp fsdp fsdp2     torch's recipe keys, FSDP2 layout for --world-size ranks, or on a device mesh
                     (--world-size mesh=dp_shard:2,tp:2: FSDP2 + HSDP + TP as dcp.save writes it there)
  zero1/2/3          a native DeepSpeed ZeRO checkpoint for --world-size ranks, laid out by --ds-config
  deepspeed          the same, at the stage the DeepSpeed config (or the ZeRO source) names
  torch              one torch.save file {"model": ..., "optim": ..., extras}: OUT itself when it
                     ends in .pt or .bin, else OUT/checkpoint.pt
  safetensors hf     the model weights (Hugging Face layout): OUT itself when it ends in
                     .safetensors, else a folder
  ds-universal       DeepSpeed's universal checkpoint (ds_to_universal's layout): OUT/latest_universal
                     and OUT/<tag>/zero/<param>/*.pt, loaded with "load_universal" at any dp
An option that does not apply to the target is refused before anything is read.

Nothing read is left out unless asked for: `model_only` (--model-only) writes the model alone,
`drop` (--drop GLOB, repeatable) leaves out the canonical keys it matches; what a target rebuilds
(DeepSpeed's low-precision copies, its layout values) and what was dropped are listed in the
summary; a value that would be lost otherwise stops the command (convert/drops.py). safetensors
holds weights only: like consolidate, it writes the model and lists what it did not write.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Callable

from ..convert import NAMES, SOURCE_OF, SOURCES, TARGET_OF, TARGETS
from ..convert.names import KeyRules
from ..convert.drops import apply_drops, dropped_summary
from ..convert.state import TrainingState, config_tie_text, describe, flat_extras, read_state
from ..convert.to_torch_layouts import fetcher_for, fsdp2_training_layout, mesh_training_layout, torch_recipe_index
from ..errors import CkptkitError, UnsupportedError, UsageError
from ..index.parallel_spec import (
    MeshSpec,
    ParallelSizes,
    check_deepspeed_ranks,
    check_mesh_ranks,
    check_ranks,
    parse_parallel,
)
from ..formats.protocols import DcpTarget, OutTensor, SafetensorsTarget, TorchSaveTarget
from ..formats.registry import Opened, format_named, format_of, open_checkpoint
from ..runner.stream import find_aliases
from ..storage.commit import Output
from ..storage.output import open_output
from ..storage.paths import read_small_file
from .. import knobs, safe_json
from ..context import RunContext, context_of
from .outputs import SAFETENSORS_SUFFIX, file_output, single_file_shards
from .reshard import tp_dims_from_rules

TORCH_FILE = "checkpoint.pt"
MAX_CONFIG_BYTES = 16 << 20  # a DeepSpeed config is a few KB
ZERO_TARGETS = ("zero", "zero1", "zero2", "zero3")
UNIVERSAL = "ds_universal"  # DeepSpeed's universal checkpoint: whole tensors, any dp and tp cuts them


@dataclass
class ConvertResult:
    out: str
    source_format: str
    target: str
    world_size: int | None
    summary: str
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines the summary adds (an HF Trainer folder's)


def _load_config(path: str | None, target: str, state: TrainingState) -> dict:
    if path is None:
        if state.ds_config is not None and state.from_deepspeed:
            # ZeRO -> ZeRO of another stage: the source's own config, with the target's stage
            try:
                cfg = json.loads(json.dumps(state.ds_config))
            except (TypeError, ValueError):  # a config pickled with values JSON cannot hold
                raise UsageError(
                    f"{state.source.path}: the ds_config stored in the checkpoint is not JSON data; "
                    f"pass --ds-config CONFIG.json"
                ) from None
            if target != "zero":  # --to deepspeed keeps the source's stage
                cfg.setdefault("zero_optimization", {})["stage"] = int(target[-1])
            return cfg
        raise UsageError(
            f"--to {'deepspeed' if target == 'zero' else target} needs --ds-config CONFIG.json: "
            f"the DeepSpeed config the job will load "
            f"with (stage, precision and sub_group_size decide the layout)"
        )
    try:  # never blocks on a FIFO, never reads a device
        raw = read_small_file(path, f"--ds-config {path}", MAX_CONFIG_BYTES)
    except CkptkitError as e:
        raise UsageError(str(e)) from None
    cfg = safe_json.loads(raw, f"--ds-config {path}", "the config", UsageError, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise UsageError(f"--ds-config {path}: expected a JSON object (a DeepSpeed config)")
    return cfg


def target_of(to: str) -> str:
    """The writer a --to name selects: dcp, zero, zero1..3, torch or safetensors."""
    if to not in TARGET_OF:
        raise UsageError(f"--to {to!r}: expected one of {', '.join(NAMES)}")
    return TARGET_OF[to]


def check_applies(
    to: str,
    world_size: int | None = None,
    ds_config: str | None = None,
    frozen: tuple[str, ...] = (),
    model_only: bool = False,
) -> None:
    """Refuse, in one sentence, an option that the target named by `to` would ignore."""
    target = target_of(to)
    if model_only and target in ZERO_TARGETS:
        raise UsageError(
            f"--model-only does not apply to --to {to}: a ZeRO checkpoint is an optimizer "
            f"checkpoint (write dcp, torch or safetensors for the model alone)"
        )
    if model_only and target == UNIVERSAL:
        raise UsageError(
            f"--model-only does not apply to --to {to}: a universal checkpoint is the fp32 masters "
            f"with their optimizer state (write dcp, torch or safetensors for the model alone)"
        )
    if world_size is not None and target in ("torch", "safetensors", UNIVERSAL):
        raise UsageError(f"--world-size does not apply to --to {to}: its output is not laid out per rank")
    if ds_config is not None and target not in ZERO_TARGETS:
        raise UsageError(
            f"--ds-config applies only to DeepSpeed targets (--to deepspeed, zero1, zero2 or zero3), not to --to {to}"
        )
    if frozen and target in ("torch", "safetensors"):
        raise UsageError(
            f"--frozen does not apply to --to {to}: only sharded targets (dcp, zero*) lay "
            f"frozen parameters out apart from buffers"
        )


def check_source(src: str, index_format: str, stage: int | None, expect_from: str) -> None:
    """--from NAME: the detected source must be what NAME means (zero1/2/3: the stage it records)."""
    if expect_from not in SOURCE_OF:
        raise UsageError(f"--from {expect_from!r}: expected one of {', '.join(NAMES)}")
    want_format, want_stage = SOURCE_OF[expect_from]
    if index_format != want_format:
        raise UsageError(f"{src}: is a {index_format} checkpoint, not {expect_from} (--from)")
    if want_stage is not None and stage != want_stage:
        raise UsageError(f"{src}: is a DeepSpeed ZeRO stage {stage} checkpoint, not {expect_from} (--from)")


def convert(
    src: str,
    out: str,
    to: str,
    world_size: "int | str | MeshSpec | None" = None,
    ds_config: str | None = None,
    expect_from: str | None = None,
    rules: KeyRules | None = None,
    frozen: tuple[str, ...] = (),
    options: RunContext | None = None,
    tag: str | None = None,
    model_only: bool = False,
    drop: tuple[str, ...] = (),
    *,
    ctx: RunContext | None = None,
) -> ConvertResult:
    """`world_size`: ranks (an int), or a device mesh for a DCP target (`MeshSpec`, or text such as
    "mesh=dp_shard:2,tp:2", as reshard's --to takes it). `ctx`: the run's context (`options=` is its
    older name)."""
    ctx = context_of(ctx, options)
    world_size, mesh = _world_or_mesh(world_size)
    target = _checked_target(to, world_size, ds_config, frozen, model_only)
    if mesh is not None and target != "dcp":
        raise UsageError(
            f"--world-size {mesh} applies only to --to dcp, fsdp or fsdp2 (DCP on a device mesh); "
            f"give --to {to} a world size"
        )
    opened, world = _open_source(src, tag, ctx, expect_from, target, world_size)
    opened, view_notes = _training_view(opened, src, target, model_only)
    single = file_output(out, target)
    rules, notes = _output_rules(opened, target, rules)
    notes = view_notes + notes
    state = read_state(opened, rules, frozen, ctx)
    notes = notes + state.notes  # what config.json says that could not be honoured
    reshaped = bool(rules and (rules.strip or rules.renames or rules.add) or frozen or model_only or drop)
    if mesh is not None:
        _refuse_folder_on_a_mesh(src, opened, mesh)
    if target == "dcp" and not single:
        done = _as_lightning_folder(opened, out, world, state, ctx, src, reshaped)
        if done is not None:
            return done
    apply_drops(state, model_only, tuple(drop))
    if target in ZERO_TARGETS:
        _refuse_tensor_parallel(src, opened)
    cfg = _load_config(ds_config, target, state) if target in ZERO_TARGETS else None
    if target == "zero":
        target = f"zero{_config_stage(cfg, ds_config)}"
    if opened.trainer is not None and not single:
        done = _as_trainer_folder(opened, out, target, world, state, cfg, ctx, src, ds_config, reshaped)
        if done is not None:
            return done
    if mesh is not None:  # a source with overlapping chunks or gaps: said first, not as a missing tp rule
        _check_tiling(src, opened)
    laid_out_notes: list[str] = []  # what the mesh layout decided, said in the summary
    files, safetensors = _write(
        opened, out, target, state, world, cfg, single, ctx, (src, ds_config), (mesh, laid_out_notes)
    )
    if mesh is not None:
        notes = [f"laid out on {mesh}", *laid_out_notes] + notes
    notes += _left_behind(opened, target)
    return ConvertResult(
        out,
        opened.index.format,
        target,
        world if target not in ("torch", "safetensors", UNIVERSAL) else None,
        _summary(state, target, safetensors),
        files,
        notes,
    )


def _open_source(
    src: str, tag: str | None, ctx: RunContext, expect_from: str | None, target: str, world_size: int | None
) -> tuple[Opened, int]:
    """SRC opened and checked against --from, and the world size the target is laid out for; a
    world size or a source the target cannot take refused before anything is read."""
    opened = open_checkpoint(src, tag=tag, follow_links=ctx.follow_links)
    refusal = format_of(opened.index).capabilities.convert_refusal
    if refusal:
        raise UnsupportedError(f"{src}: {refusal}")
    if expect_from is not None:
        stage = (opened.index.metadata.get("deepspeed") or {}).get("stage")
        check_source(src, opened.index.format, stage, expect_from)
    world = world_size or opened.index.world_size or 1
    if target.startswith("zero"):
        check_deepspeed_ranks(world, f"--world-size {world}")
    if target in ZERO_TARGETS:  # a pipeline source has no ZeRO layout yet
        format_of(opened.index).refuse_relayout(src, opened.index)
    return opened, world


def _training_view(opened: Opened, src: str, target: str, model_only: bool) -> tuple[Opened, list[str]]:
    """SRC as its format's training-state view, where it stores its training state otherwise than
    torch names it (MCore: stacked layers, param groups without members), and the view's notes.
    The optimizer is left out where it would not be written (--model-only, a safetensors target)."""
    view = getattr(format_of(opened.index), "training_index", None)
    if view is None:
        return opened, []
    optimizer = not model_only and target != "safetensors"
    index, notes = view(opened.index, optimizer, "convert the model alone (--model-only)", src)
    return dataclasses.replace(opened, index=index), notes


def _refuse_folder_on_a_mesh(src: str, opened: Opened, mesh: MeshSpec) -> None:
    """A device mesh writes a plain DCP folder: a trainer's or Lightning's folder is refused."""
    if opened.trainer is not None or _is_lightning(opened):
        raise UnsupportedError(
            f"{src}: --world-size {mesh} writes a plain DCP folder; writing "
            f"{'an HF Trainer' if opened.trainer is not None else 'a Lightning'} folder "
            f"on a device mesh is not supported yet (give a world size)"
        )


def _refuse_tensor_parallel(src: str, opened: Opened) -> None:
    """A tensor-parallel DeepSpeed source has no ZeRO target yet: reshard it first."""
    if (opened.index.metadata.get("parallel") or {}).get("tp", 1) > 1:
        raise UnsupportedError(
            f"{src}: converting a tensor-parallel DeepSpeed checkpoint to ZeRO is not supported "
            f"yet; reshard it (--to tp=1,dp=N gives a plain ZeRO checkpoint), or convert it to "
            f"torch, safetensors or DCP"
        )


def _check_tiling(src: str, opened: Opened) -> None:
    """Every tensor of SRC tiled by its chunks exactly (no overlap, no gap), as a mesh needs."""
    from ..runner.plan import check_tiling

    for entry in opened.index.tensors.values():
        check_tiling(entry, lambda _rel: src)


def _world_or_mesh(world_size: "int | str | MeshSpec | None") -> tuple[int | None, MeshSpec | None]:
    """--world-size as (ranks, mesh): a number, or a device mesh `mesh=dp_shard:2,tp:2` (reshard's
    --to spelling); DeepSpeed's model-parallel sizes are reshard's, not convert's."""
    if world_size is None or isinstance(world_size, MeshSpec):
        return (
            (None, None)
            if world_size is None
            else (world_size.world_size, check_mesh_ranks(world_size, "--world-size"))
        )
    if isinstance(world_size, int) and not isinstance(world_size, bool):
        return world_size, None  # checked with the other options (a clear sentence for 0 or too many)
    text = str(world_size).strip()
    if not text.startswith("mesh=") and not re.fullmatch(r"[+-]?\d+", text):
        also = " (DeepSpeed's tp=/pp=/ep=/dp= sizes are for reshard --to)" if "=" in text else ""
        raise UsageError(
            f"--world-size {text!r}: expected a number of ranks (e.g. 4) or a device mesh "
            f"(e.g. mesh=dp_shard:2,tp:2){also}"
        )
    parsed = parse_parallel(text, "--world-size")
    if isinstance(parsed, ParallelSizes):  # not reached: the text is a number or mesh=...
        raise UsageError(f"--world-size {text}: DeepSpeed's parallel sizes are given to reshard --to")
    if isinstance(parsed, MeshSpec):
        return parsed.world_size, check_mesh_ranks(parsed, "--world-size")
    return parsed, None


def _checked_target(
    to: str, world_size: int | None, ds_config: str | None, frozen: tuple[str, ...], model_only: bool
) -> str:
    """The writer `to` selects, once every option was checked to apply to it (nothing read yet)."""
    target = target_of(to)
    check_applies(to, world_size, ds_config, frozen, model_only)
    if world_size is not None and world_size < 1:
        raise UsageError(f"--world-size must be at least 1 (got {world_size})")
    if world_size is not None:
        check_ranks(world_size, f"--world-size {world_size}")
    return target


def _output_rules(opened: Opened, target: str, rules: KeyRules | None) -> tuple[KeyRules | None, list[str]]:
    """The name rules to convert with, and the note saying why when they are the reader's default:
    safetensors (weights for from_pretrained) strips the reader's default prefix, as consolidate does."""
    if target != "safetensors":
        return rules, []
    from .consolidate import key_rules

    chosen = key_rules(opened.index, rules)
    if chosen is None or chosen is rules:
        return rules, []
    return chosen, [
        f"names: stripped {', '.join(chosen.strip)} from every model name (the LightningModule "
        f"attribute holding the network), so they are the network's own; --strip-prefix or "
        f"--rename replace this"
    ]


def _is_lightning(opened: Opened) -> bool:
    from .lightning_folder import is_folder

    return is_folder(opened)


def _as_lightning_folder(
    opened: Opened, out: str, world: int, state: TrainingState, ctx: RunContext, src: str, reshaped: bool
) -> ConvertResult | None:
    """--to dcp of Lightning's FSDP folder: its own kind again (None: the source is no such folder)."""
    from .lightning_folder import is_folder, write_folder

    if not is_folder(opened):
        return None
    if reshaped:
        raise UsageError(
            f"{src}: --rename, --strip-prefix, --add-prefix, --frozen, --model-only and --drop do "
            f"not apply when a Lightning FSDP folder is written as one (its DCP part is laid out "
            f"again as it is, beside its meta.pt); convert --to torch to change names or state"
        )
    res = write_folder(opened, out, world, ctx, src)
    return ConvertResult(out, opened.index.format, "dcp", world, _summary(state, "dcp", None), res.files, res.notes())


def _as_trainer_folder(
    opened: Opened,
    out: str,
    target: str,
    world: int,
    state: TrainingState,
    cfg: dict | None,
    ctx: RunContext,
    src: str,
    ds_config: str | None,
    reshaped: bool,
) -> ConvertResult | None:
    """checkpoint-N/ to its own kind: a Trainer folder again (None: `target` is another kind)."""
    from .trainer_folder import convert_folder, same_kind

    if not same_kind(opened.trainer, target):
        return None
    res = convert_folder(opened, out, target, world, state, cfg, ctx, src, ds_config, reshaped)
    return ConvertResult(out, opened.index.format, target, world, _summary(state, target, None), res.files, res.notes())


def _write(
    opened: Opened,
    out: str,
    target: str,
    state: TrainingState,
    world: int,
    cfg: dict | None,
    single: bool,
    ctx: RunContext,
    sources: tuple,
    on_mesh: tuple[MeshSpec | None, list[str]] = (None, []),
) -> tuple[list[str], tuple | None]:
    """OUT as `target`, committed whole: (the files written, the safetensors plan when it is one).
    `on_mesh`: (the device mesh of a DCP target or None, a list the layout's notes are added to)."""
    safetensors = _safetensors_plan(state) if target == "safetensors" else None
    if safetensors is not None and single:
        single_file_shards(out, safetensors[0], knobs.parse_size(knobs.MAX_SHARD_SIZE))
    if target == "safetensors":
        total = sum(t.nbytes for t in safetensors[0])
    else:
        total = sum(e.nbytes for e in state.model.values()) + sum(
            e.nbytes for m in state.param_states.values() for e in m.values()
        )
    ctx.progress.start(total, f"convert {opened.index.format} -> {target}")
    with open_output(out, overwrite=ctx.overwrite, group=ctx.group, sources=sources, single_file=single) as dest:
        files = _write_into(dest, target, state, world, cfg, safetensors, single, ctx, on_mesh)
    ctx.progress.close()
    return files, safetensors


def _write_into(
    dest: Output,
    target: str,
    state: TrainingState,
    world: int,
    cfg: dict | None,
    safetensors: tuple | None,
    single: bool,
    ctx: RunContext,
    on_mesh: tuple[MeshSpec | None, list[str]] = (None, []),
) -> list[str]:
    """`target`'s files in `dest`, each laid out here and written by the registry's writer."""
    if target == "dcp":
        index, resolver = torch_recipe_index(state, "dcp")
        index.world_size = world
        mesh, notes = on_mesh
        if mesh is not None:
            layout, said = mesh_training_layout(index, state, mesh, tp_dims_from_rules())
            notes.extend(said)
        else:
            layout = fsdp2_training_layout(index, state, world)
        laid_out = DcpTarget(index, fetcher_for(state, resolver), layout)
        return format_named("dcp").write(laid_out, dest, ctx)
    if target.startswith("zero"):
        from ..convert.to_zero import zero_target_from_state

        return format_named("deepspeed").write(zero_target_from_state(state, int(target[-1]), world, cfg), dest, ctx)
    if target == UNIVERSAL:
        from ..convert.to_universal import universal_target_from_state

        return format_named(UNIVERSAL).write(universal_target_from_state(state), dest, ctx)
    if target == "torch":
        name = dest.name if single else TORCH_FILE
        index, resolver = torch_recipe_index(state, "torch")
        return format_named("torch_save").write(TorchSaveTarget(name, index, fetcher_for(state, resolver)), dest, ctx)
    return _write_safetensors(dest, safetensors, ctx, single)


def _left_behind(opened: Opened, target: str) -> list[str]:
    """What a plain `target` does not hold of a Trainer or Lightning folder: said, not silent."""
    notes: list[str] = []
    if opened.trainer is not None:  # the trainer's side files stay behind
        from .trainer_folder import left_behind

        notes += left_behind(opened.trainer, target)
    from . import lightning_folder

    return notes + lightning_folder.left_behind(opened, target)  # a Lightning checkpoint written as a plain one


def _summary(state: TrainingState, target: str, safetensors: tuple | None) -> str:
    """What was written, what the target rebuilds and what was dropped on request: one line."""
    summary = _safetensors_summary(state, safetensors) if target == "safetensors" else describe(state)
    return "; ".join(x for x in (summary, _derived_summary(state, target), dropped_summary(state)) if x)


def _config_stage(cfg: dict | None, ds_config: str | None) -> int:
    """--to deepspeed: the stage the DeepSpeed config names."""
    stage = ((cfg or {}).get("zero_optimization") or {}).get("stage")
    if stage not in (1, 2, 3):
        where = f"--ds-config {ds_config}" if ds_config else "the source's DeepSpeed config"
        raise UsageError(
            f"--to deepspeed: {where} names no ZeRO stage 1, 2 or 3 (zero_optimization.stage); "
            f"pass --to zero1, zero2 or zero3"
        )
    return stage


def _safetensors_plan(state: TrainingState) -> tuple[list[OutTensor], dict[str, str], Callable]:
    """(tensors to write, tied names written once, the fetcher) for a safetensors target."""
    index, resolver = torch_recipe_index(state, "safetensors")
    model = {k[len("model.") :]: e for k, e in index.tensors.items() if (e.path or ())[:1] == ("model",)}
    aliases = find_aliases(model)
    tensors = [OutTensor(name, e, e.dtype) for name, e in model.items() if name not in aliases]
    return tensors, aliases, fetcher_for(state, resolver)


def _write_safetensors(dest: Output, plan: tuple, ctx: RunContext, single: bool) -> list[str]:
    tensors, aliases, fetcher = plan
    basename = dest.name[: -len(SAFETENSORS_SUFFIX)] if single else "model"
    weights = SafetensorsTarget(fetcher, tensors, knobs.parse_size(knobs.MAX_SHARD_SIZE), basename, aliases)
    return format_named("safetensors").write(weights, dest, ctx)


def _safetensors_summary(state: TrainingState, plan: tuple) -> str:
    """What a weights-only target holds, and what it leaves out (never reported as written)."""
    tensors, aliases, _ = plan
    text = f"{len(tensors)} model tensors" + (f" ({len(aliases)} tied, written once)" if aliases else "")
    text += config_tie_text(state)
    dropped = []
    n_part = sum(len(m) for m in state.param_states.values())
    n_whole = sum(len(m) for m in state.whole_states.values())
    if n_part or n_whole or (state.has_optimizer and not state.optimizer_dropped):
        keys = ", ".join(state.state_keys)
        dropped.append(
            f"optimizer state ({n_part} state tensors, {n_whole} per-parameter values"
            + (f": {keys}" if keys else "")
            + f"; {len(state.group_params)} param groups)"
        )
    extras = len(flat_extras(state.extras)) + len(state.ds)
    if extras:
        dropped.append(f"{extras} training counters and extras")
    if dropped:
        text += f"; not written: {', '.join(dropped)} (safetensors holds weights only)"
    return text


def _derived_summary(state: TrainingState, target: str) -> str:
    """The source values the target does not copy because it rebuilds them (never lost silently)."""
    shown = {k: w for k, w in state.derived.items() if w != "empty"}
    if not shown:
        return ""
    by_why: dict[str, list[str]] = {}
    for key, why in shown.items():
        by_why.setdefault(why, []).append(key)
    parts = []
    for why, keys in by_why.items():
        names = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        parts.append(f"{len(keys)} {why} ({names})")
    verb = "rebuilt from the config and masters" if target.startswith("zero") else "not copied (DeepSpeed's own)"
    return f"{verb}: " + "; ".join(parts)


__all__ = [
    "convert",
    "ConvertResult",
    "TARGETS",
    "SOURCES",
    "TORCH_FILE",
    "check_applies",
    "check_source",
    "file_output",
    "target_of",
]
