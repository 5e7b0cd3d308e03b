"""`ckptkit consolidate`: any checkpoint -> Hugging Face style safetensors of the model.

OUT is a folder (model.safetensors, or shards with their index), or the file itself when it ends
in .safetensors and the model fits in one shard. Keys are the model's own state_dict keys (the
"model" container of {"model":..,"optim":..} checkpoints is dropped). Optimizer state only on
request, in separate optimizer*.safetensors files. Streams slab by slab: memory is bounded by the budget, not the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import knobs
from ..errors import UsageError
from ..formats.registry import open_checkpoint
from ..formats.safetensors.writer import OutTensor, write_safetensors
from ..index.dtypes import is_floating
from ..index.serialize import safe_value
from ..runner.fetch import Fetcher
from ..runner.stream import find_aliases
from ..storage.output import OutputDir, OutputFile
from .outputs import file_output, single_file_shards
from .keys import split_roles
from .options import RunOptions


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


def consolidate(src: str, out: str, dtype: str | None = None, max_shard_size: str | int = knobs.MAX_SHARD_SIZE,
                include_optimizer: bool = False, options: RunOptions | None = None,
                tag: str | None = None) -> ConsolidateResult:
    options = options or RunOptions()
    opened = open_checkpoint(src, tag=tag, follow_links=options.follow_links)
    index = opened.index
    split = split_roles(index)
    if not split.model:
        raise UsageError(f"{src}: found no model tensors to consolidate "
                         f"({len(index.tensors)} tensors, none under a model container)")
    max_bytes = knobs.parse_size(max_shard_size)

    # DeepSpeed: fp32 masters, with frozen params and buffers upcast as zero_to_fp32 does
    default = dtype or index.metadata.get("consolidate_dtype")

    def out_dtype(key: str) -> str:
        src_dtype = index.tensors[key].dtype
        return default if default and is_floating(src_dtype) else src_dtype

    model_entries = {name: index.tensors[key] for name, key in split.model.items()}
    aliases = find_aliases(model_entries)
    model = [OutTensor(name, index.tensors[key], out_dtype(key))
             for name, key in split.model.items() if name not in aliases]
    optim = [OutTensor(name, index.tensors[key], index.tensors[key].dtype)
             for name, key in split.optim.items()] if include_optimizer else []
    single = file_output(out, "safetensors")
    if single:
        if include_optimizer:
            raise UsageError(f"{out}: --include-optimizer writes optimizer*.safetensors beside the model, so "
                             f"OUT must be a folder, not a .safetensors file")
        single_file_shards(out, model, max_bytes, " (or a larger --max-shard-size)")
    total = sum(t.nbytes for t in model + optim)
    options.progress.start(total, "consolidate")
    fetcher = Fetcher(opened.source, index=index)
    files: list[str] = []
    output = OutputFile if single else OutputDir
    with output(out, overwrite=options.overwrite, group=options.group, sources=(src,)) as target:
        basename = target.name[: -len(".safetensors")] if single else "model"
        files += write_safetensors(target, fetcher, model, basename=basename, max_shard_bytes=max_bytes,
                                   slab_bytes=options.slab_bytes, workers=options.workers,
                                   aliases=aliases, progress=options.progress)
        if optim:
            objects = {name: safe_value(index.objects[key].data) for name, key in split.optim_objects.items()}
            files += write_safetensors(target, fetcher, optim, basename="optimizer",
                                       max_shard_bytes=max_bytes, slab_bytes=options.slab_bytes,
                                       workers=options.workers, objects=objects, progress=options.progress)
    options.progress.close()
    return ConsolidateResult(out, index.format, len(model_entries), sum(t.nbytes for t in model),
                             files, aliases, len(optim), list(split.other))
