"""`ckptkit convert`: a training checkpoint of one backend as another, optimizer state included.

Source (any format ckptkit reads) -> canonical training state (convert/state.py) -> target:
  dcp           torch's recipe keys, FSDP2 layout for --world-size ranks
  zero1/2/3     a native DeepSpeed ZeRO checkpoint for --world-size ranks, laid out by --ds-config
  torch         one torch.save file OUT/checkpoint.pt: {"model": ..., "optim": ..., extras}
  safetensors   the model weights (Hugging Face layout)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..convert import SOURCES, TARGETS
from ..convert.names import KeyRules
from ..convert.state import TrainingState, describe, read_state
from ..convert.to_torch_layouts import fetcher_for, fsdp2_training_layout, torch_recipe_index
from ..errors import UsageError
from ..formats.dcp.writer import write_dcp
from ..formats.registry import open_checkpoint
from ..formats.safetensors.writer import OutTensor, write_safetensors
from ..formats.torch_save.writer import write_torch_save
from ..runner.stream import find_aliases
from ..storage.output import OutputDir
from .. import knobs, safe_json
from .options import RunOptions

TORCH_FILE = "checkpoint.pt"
MAX_CONFIG_BYTES = 16 << 20  # a DeepSpeed config is a few KB
FROM_NAMES = {"torch": "torch_save"}  # --from names -> index formats


@dataclass
class ConvertResult:
    out: str
    source_format: str
    target: str
    world_size: int | None
    summary: str
    files: list[str] = field(default_factory=list)


def _load_config(path: str | None, target: str, state: TrainingState) -> dict:
    if path is None:
        if state.ds_config is not None and state.source.index.format == "deepspeed":
            # ZeRO -> ZeRO of another stage: the source's own config, with the target's stage
            try:
                cfg = json.loads(json.dumps(state.ds_config))
            except (TypeError, ValueError):  # a config pickled with values JSON cannot hold
                raise UsageError(f"{state.source.path}: the ds_config stored in the checkpoint is not JSON data; "
                                 f"pass --ds-config CONFIG.json") from None
            cfg.setdefault("zero_optimization", {})["stage"] = int(target[-1])
            return cfg
        raise UsageError(f"--to {target} needs --ds-config CONFIG.json: the DeepSpeed config the job will load "
                         f"with (stage, precision and sub_group_size decide the layout)")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UsageError(f"--ds-config {path}: cannot read it ({e.strerror})") from None
    cfg = safe_json.loads(raw, f"--ds-config {path}", "the config", UsageError, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise UsageError(f"--ds-config {path}: expected a JSON object (a DeepSpeed config)")
    return cfg


def convert(src: str, out: str, to: str, world_size: int | None = None, ds_config: str | None = None,
            expect_from: str | None = None, rules: KeyRules | None = None, frozen: tuple[str, ...] = (),
            options: RunOptions | None = None, tag: str | None = None) -> ConvertResult:
    options = options or RunOptions()
    if to not in TARGETS:
        raise UsageError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")
    if world_size is not None and world_size < 1:
        raise UsageError(f"--world-size must be at least 1 (got {world_size})")
    opened = open_checkpoint(src, tag=tag, follow_links=options.follow_links)
    if expect_from is not None and opened.index.format != FROM_NAMES.get(expect_from, expect_from):
        raise UsageError(f"{src}: is a {opened.index.format} checkpoint, not {expect_from} (--from)")
    state = read_state(opened, rules, frozen)
    world = world_size or opened.index.world_size or 1
    total = sum(e.nbytes for e in state.model.values()) + sum(
        e.nbytes for m in state.moments.values() for e in m.values())
    options.progress.start(total, f"convert {opened.index.format} -> {to}")
    with OutputDir(out, overwrite=options.overwrite, group=options.group, sources=(src, ds_config)) as target:
        if to == "dcp":
            index, resolver = torch_recipe_index(state, "dcp")
            index.world_size = world
            files = write_dcp(target, index, fetcher_for(state, resolver), fsdp2_training_layout(index, state, world),
                              slab_bytes=options.slab_bytes, workers=options.workers, progress=options.progress)
        elif to.startswith("zero"):
            from ..convert.to_zero import write_zero_from_state

            cfg = _load_config(ds_config, to, state)
            files = write_zero_from_state(target, state, int(to[-1]), world, cfg, slab_bytes=options.slab_bytes,
                                          workers=options.workers, progress=options.progress)
        elif to == "torch":
            index, resolver = torch_recipe_index(state, "torch")
            write_torch_save(target, TORCH_FILE, index, fetcher_for(state, resolver), slab_bytes=options.slab_bytes,
                             progress=options.progress)
            files = [TORCH_FILE]
        else:
            files = _write_safetensors(target, state, options)
    options.progress.close()
    return ConvertResult(out, opened.index.format, to, world if to not in ("torch", "safetensors") else None,
                         describe(state), files)


def _write_safetensors(target: OutputDir, state: TrainingState, options: RunOptions) -> list[str]:
    index, resolver = torch_recipe_index(state, "safetensors")
    model = {k[len("model."):]: e for k, e in index.tensors.items() if (e.path or ())[:1] == ("model",)}
    aliases = find_aliases(model)
    tensors = [OutTensor(name, e, e.dtype) for name, e in model.items() if name not in aliases]
    return write_safetensors(target, fetcher_for(state, resolver), tensors, basename="model",
                             max_shard_bytes=knobs.parse_size(knobs.MAX_SHARD_SIZE), slab_bytes=options.slab_bytes,
                             workers=options.workers, aliases=aliases, progress=options.progress)


__all__ = ["convert", "ConvertResult", "TARGETS", "SOURCES", "TORCH_FILE"]
