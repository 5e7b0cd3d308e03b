"""`ckptkit reshard`: the same format, laid out for a new world size.

DCP: FSDP2's layout at M ranks (torch.chunk on dim 0 for the tensors the source sharded;
replicated tensors stay whole, written once), one data file per rank, values copied verbatim.
DeepSpeed: a native ZeRO checkpoint for M data-parallel ranks (formats/deepspeed/writer.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedError, UsageError
from ..formats.dcp.writer import write_dcp
from ..formats.deepspeed.writer import write_zero
from ..formats.registry import open_checkpoint
from ..index.layouts import fsdp2_layout
from ..runner.fetch import Fetcher
from ..storage.output import OutputDir
from .options import RunOptions


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
            options: RunOptions | None = None, tag: str | None = None) -> ReshardResult:
    options = options or RunOptions()
    if to < 1:
        raise UsageError(f"--to must be at least 1 (got {to})")
    opened = open_checkpoint(src, tag=tag, follow_links=options.follow_links)
    index = opened.index
    if opened.trainer is not None:  # checkpoint-N/ as a unit: parts resharded, side files copied
        from .trainer_folder import reshard_folder, source_world

        if expect_from is not None and source_world(opened) != expect_from:
            raise UsageError(f"{src}: was saved at world size {source_world(opened)}, not {expect_from} (--from)")
        res = reshard_folder(opened, out, to, options, src)
        return ReshardResult(out, index.format, res.from_world_size, to, res.files, res.tensors, res.bytes,
                             res.notes())
    if expect_from is not None and index.world_size != expect_from:
        raise UsageError(f"{src}: was saved at world size {index.world_size}, not {expect_from} (--from)")
    from .lightning_folder import is_folder, write_folder

    if is_folder(opened):  # Lightning's FSDP folder as a unit: its DCP part resharded, meta.pt copied
        res = write_folder(opened, out, to, options, src)
        return ReshardResult(out, index.format, res.from_world_size, to, res.files, res.tensors, res.bytes,
                             res.notes())
    if index.format not in ("dcp", "deepspeed"):
        raise UnsupportedError(f"{src}: a {index.format} checkpoint is not sharded by world size, so there "
                               f"is nothing to reshard (reshard takes a DCP folder or a DeepSpeed checkpoint)")
    options.progress.start(index.total_tensor_bytes, f"reshard {index.world_size}->{to}")
    with OutputDir(out, overwrite=options.overwrite, group=options.group, sources=(src,)) as target:
        if index.format == "deepspeed":
            files = write_zero(target, index, opened.source, to, slab_bytes=options.slab_bytes,
                               workers=options.workers, progress=options.progress)
        else:
            files = write_dcp(target, index, Fetcher(opened.source), fsdp2_layout(index, to),
                              slab_bytes=options.slab_bytes, workers=options.workers, source=opened.source,
                              progress=options.progress)
    options.progress.close()
    return ReshardResult(out, index.format, index.world_size, to, files, len(index.tensors),
                         index.total_tensor_bytes)
