"""Which writer lays a DeepSpeed checkpoint out at new sizes: one table keyed by its layout's family.

The family comes from the layout's fields (layout.py), so no two writers can both claim a
checkpoint and none depends on the order it is asked in.
"""

from __future__ import annotations

from typing import Any, Callable

from ...context import RunContext
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...storage.commit import Output
from ...storage.source import Source
from ...runner.fetch import Fetcher
from . import split_ep, split_pp, split_tp
from .group_plan import StatePlanner
from .layout import DeepSpeedLayout
from .native import native_of
from .tag_writer import tag_name, write_tag, zero_config
from .moe_pipeline_writer import write_pipeline_moe_zero
from .refusals import refuse_pipeline_moe
from .writer import DEFAULT_SUB_GROUP_SIZE, cell_files, write_zero

Writer = Callable[..., list[str]]


WRITERS: dict[str, Writer] = {
    "pipeline_moe": write_pipeline_moe_zero,  # MoE in a PipelineModule: keeps pp; pp=P,ep=E,dp=W
}


def write_resharded(
    out: Output, index: CheckpointIndex, source: Source, to: int | ParallelSizes, *, ctx: RunContext
) -> list[str]:
    """`reshard --to N` or `--to tp=..,pp=..,ep=..,dp=..`: the writer of the source's family lays it out."""
    layout = DeepSpeedLayout.of(index)
    if layout.family in ONE_WRITER:
        return write_layout(out, index, source, layout.resized(to, index.root), ctx=ctx)
    return WRITERS[layout.family](out, index, source, to, ctx=ctx)


ONE_WRITER = ("zero", "tensor_parallel", "moe", "moe_tp", "moe_whole_tp", "pipeline", "pipeline_tp")


def write_layout(
    out: Output, index: CheckpointIndex, source: Source, sizes: ParallelSizes, *, ctx: RunContext
) -> list[str]:
    """The source at `sizes`: split over tp, then pp, then ep, each (stage, tp rank) cell written
    as a ZeRO checkpoint (module docstring)."""
    zinfo = native_of(index).cell()
    tag = tag_name(zinfo.files.tag, index)
    sub_group_size = zero_config(index).get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    files: dict[str, tuple[Any, Fetcher]] = {}
    copied: list[tuple[str, str]] = []
    for lane in split_tp.lanes(index, source, sizes):
        for stage in split_pp.stages(index, lane, sizes):
            cell = split_ep.cell(index, lane, stage, sizes)
            states = StatePlanner(stage.index, lane.fetcher)
            group_size = int(sub_group_size) if sub_group_size is not None else None
            structures = cell_files(stage.index, stage.info, sizes.dp, tag, group_size, states, cell)
            files.update((name, (structure, lane.fetcher)) for name, structure in structures.items())
        for written, copies in (split_pp.lane_files(index, lane, tag), split_ep.lane_experts(index, lane, sizes, tag)):
            files.update((name, (structure, lane.fetcher)) for name, structure in written.items())
            copied += copies
    copied += split_ep.whole_expert_copies(index, tag, sizes)
    return write_tag(out, source, tag, files, ctx, copied=copied, scripts=zinfo.files.tag is not None)


def write_at_world_size(
    out: Output, index: CheckpointIndex, source: Source, world_size: int, *, ctx: RunContext
) -> list[str]:
    """A DeepSpeed checkpoint's own files for a new world size, without a model-parallel writer:
    experts keep the source's ep size (split_ep.py); anything else is rewritten as one ZeRO
    checkpoint (writer.py refuses the model-parallel layouts it cannot lay out)."""
    if DeepSpeedLayout.of(index).has_experts:
        refuse_pipeline_moe(index)  # a MoE PipelineModule: its stages are laid out by reshard --to pp=...
        return write_resharded(out, index, source, world_size, ctx=ctx)
    return write_zero(out, index, source, world_size, ctx=ctx)
