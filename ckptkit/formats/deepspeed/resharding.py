"""Which writer lays a DeepSpeed checkpoint out at new sizes: one table keyed by its layout's family.

The family comes from the layout's fields (layout.py), so no two writers can both claim a
checkpoint and none depends on the order it is asked in.
"""

from __future__ import annotations

from typing import Callable

from ...context import RunContext
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...storage.commit import Output
from ...storage.source import Source
from .layout import DeepSpeedLayout
from .moe_pipeline_writer import write_pipeline_moe_zero
from .moe_tp_writer import write_moe_tp_zero
from .moe_whole_writer import write_whole_experts
from .moe_writer import write_moe_zero
from .pipeline_tp_writer import write_3d_zero
from .pipeline_writer import write_pp_zero
from .tp_writer import write_tp_zero
from .writer import write_zero

Writer = Callable[..., list[str]]


def _write_zero(out: Output, index: CheckpointIndex, source: Source, to: int | ParallelSizes, *, ctx: RunContext):
    """A plain ZeRO checkpoint: a world size (or dp=N alone), refused otherwise (layout.resized)."""
    sizes = DeepSpeedLayout.of(index).resized(to, index.root)
    return write_zero(out, index, source, sizes.dp, ctx=ctx)


WRITERS: dict[str, Writer] = {
    "zero": _write_zero,
    "tensor_parallel": write_tp_zero,  # --to N keeps the source's tp; tp=T,dp=W
    "pipeline": write_pp_zero,  # --to N keeps the source's pp; pp=P,dp=W
    "pipeline_tp": write_3d_zero,  # --to N keeps tp and pp; tp=T,pp=P,dp=W
    "moe": write_moe_zero,  # --to N keeps ep where it divides; ep=E,dp=W
    "moe_tp": write_moe_tp_zero,  # experts sliced over tp: --to N keeps tp and ep; tp=T,ep=E,dp=W
    "moe_whole_tp": write_whole_experts,  # whole experts: --to N keeps tp and ep; tp=T,ep=E,dp=W
    "pipeline_moe": write_pipeline_moe_zero,  # MoE in a PipelineModule: keeps pp; pp=P,ep=E,dp=W
}


def write_resharded(
    out: Output, index: CheckpointIndex, source: Source, to: int | ParallelSizes, *, ctx: RunContext
) -> list[str]:
    """`reshard --to N` or `--to tp=..,pp=..,ep=..,dp=..`: the writer of the source's family lays it out."""
    return WRITERS[DeepSpeedLayout.of(index).family](out, index, source, to, ctx=ctx)


def write_at_world_size(
    out: Output, index: CheckpointIndex, source: Source, world_size: int, *, ctx: RunContext
) -> list[str]:
    """A DeepSpeed checkpoint's own files for a new world size, without a model-parallel writer:
    experts keep the source's ep size (moe_writer.py); anything else is rewritten as one ZeRO
    checkpoint (writer.py refuses the model-parallel layouts it cannot lay out)."""
    if DeepSpeedLayout.of(index).has_experts:
        return write_moe_zero(out, index, source, world_size, ctx=ctx)
    return write_zero(out, index, source, world_size, ctx=ctx)
