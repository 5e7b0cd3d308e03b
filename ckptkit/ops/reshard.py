"""`ckptkit reshard`: the same format, laid out for a new world size.

Any registered format whose capabilities say it `reshards` (formats/registry.py) writes itself:
DCP: FSDP2's layout at M ranks (torch.chunk on dim 0 for the tensors the source sharded;
replicated tensors stay whole, written once), one data file per rank, values copied verbatim.
DeepSpeed: a native ZeRO checkpoint for M data-parallel ranks (formats/deepspeed/writer.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedError, UsageError
from ..formats.registry import format_of, open_checkpoint
from ..storage.output import open_output
from ..context import RunContext, context_of


@dataclass
class ReshardResult:
    out: str
    format: str
    from_world_size: int | None
    to_world_size: int
    files: list[str]
    tensors: int
    bytes: int
    notes: list[str] = field(default_factory=list)  # lines the summary adds (an HF Trainer folder's)


def reshard(src: str, out: str, to: int, expect_from: int | None = None,
            options: RunContext | None = None, tag: str | None = None, *,
            ctx: RunContext | None = None) -> ReshardResult:
    """`ctx`: the run's context (`options=` is its older name)."""
    ctx = context_of(ctx, options)
    if to < 1:
        raise UsageError(f"--to must be at least 1 (got {to})")
    opened = open_checkpoint(src, tag=tag, follow_links=ctx.follow_links)
    index = opened.index
    if opened.trainer is not None:  # checkpoint-N/ as a unit: parts resharded, side files copied
        from .trainer_folder import reshard_folder, source_world

        if expect_from is not None and source_world(opened) != expect_from:
            raise UsageError(f"{src}: was saved at world size {source_world(opened)}, not {expect_from} (--from)")
        res = reshard_folder(opened, out, to, ctx, src)
        return ReshardResult(out, index.format, res.from_world_size, to, res.files, res.tensors, res.bytes,
                             res.notes())
    if expect_from is not None and index.world_size != expect_from:
        raise UsageError(f"{src}: was saved at world size {index.world_size}, not {expect_from} (--from)")
    from .lightning_folder import is_folder, write_folder

    if is_folder(opened):  # Lightning's FSDP folder as a unit: its DCP part resharded, meta.pt copied
        res = write_folder(opened, out, to, ctx, src)
        return ReshardResult(out, index.format, res.from_world_size, to, res.files, res.tensors, res.bytes,
                             res.notes())
    fmt = format_of(index)
    if not fmt.capabilities.reshards:
        raise UnsupportedError(f"{src}: a {index.format} checkpoint is not sharded by world size, so there "
                               f"is nothing to reshard (reshard takes a DCP folder or a DeepSpeed checkpoint)")
    ctx.progress.start(index.total_tensor_bytes, f"reshard {index.world_size}->{to}")
    with open_output(out, overwrite=ctx.overwrite, group=ctx.group, sources=(src,)) as target:
        files = fmt.reshard(opened, target, to, ctx)
    ctx.progress.close()
    return ReshardResult(out, index.format, index.world_size, to, files, len(index.tensors),
                         index.total_tensor_bytes)
