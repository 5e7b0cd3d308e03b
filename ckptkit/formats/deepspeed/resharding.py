"""The one DeepSpeed writer: a checkpoint split over tp, then pp, then ep, each cell written once.

It mirrors the one reader (read.py), which reads each (stage, tp rank) cell as a ZeRO checkpoint
and joins them over ep, pp and tp. Here the joined index is split the other way, each split the
identity at size 1:

- tp (split_tp.py): each new tp rank's lane, an index of its slices of the full tensors
  (tp_geometry's TpSlicer), with the source's ZeRO record at its slice shapes;
- pp (split_pp.py): the lane's new stages, a PipelineModule's layer-file stages
  (pipeline_stages.py) or a MoE PipelineModule's mp-rank stages (moe_stages.py), each under mp
  rank stage x tp + tp rank;
- ep (split_ep.py): each cell's expert groups over the ranks of their expert-parallel rank
  (writer.ExpertSplit).

Each (stage, tp rank) cell is then written by writer.cell_files, the one ZeRO cell writer, and
the files that do not change (layer files kept whole, expert files) are copied byte for byte.
What the new sizes may be, and every refusal of them, is the layout's (layout.resized).
"""

from __future__ import annotations

from typing import Any

from ...context import RunContext
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from . import split_ep, split_pp, split_tp
from .group_plan import StatePlanner
from .grow_tp import with_tp_rules
from .layout import DeepSpeedLayout
from .native import native_of
from .refusals import refuse_pipeline_moe
from .tag_writer import tag_name, write_tag, zero_config
from .writer import DEFAULT_SUB_GROUP_SIZE, cell_files, write_zero


def write_resharded(
    out: Output, index: CheckpointIndex, source: Source, to: int | ParallelSizes, *, ctx: RunContext
) -> list[str]:
    """`reshard --to N` or `--to tp=..,pp=..,ep=..,dp=..`: the source split over tp, pp and ep at
    the sizes its layout allows (module docstring); adding tp with --tp-rules FILE, the sizes of the
    same model saved with tp (grow_tp.py)."""
    index = with_tp_rules(index, to)
    sizes = DeepSpeedLayout.of(index).resized(to, index.root)
    zinfo = native_of(index).cell()
    tag = tag_name(zinfo.files.tag, index)
    sub_group_size = zero_config(index).get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    group_size = int(sub_group_size) if sub_group_size is not None else None
    files: dict[str, tuple[Any, Fetcher]] = {}
    copied: list[tuple[str, str]] = []
    stage_copies: list[tuple[str, str]] = []
    for lane in split_tp.lanes(index, source, sizes):
        for stage in split_pp.stages(index, lane, sizes):
            cell = split_ep.cell(index, lane, stage, sizes)
            states = StatePlanner(stage.index, lane.fetcher)
            structures = cell_files(stage.index, stage.info, sizes.dp, tag, group_size, states, cell)
            files.update((name, (structure, lane.fetcher)) for name, structure in structures.items())
            stage_copies += stage.copied
        for written, copies in (split_pp.lane_files(index, lane, tag), split_ep.lane_experts(index, lane, sizes, tag)):
            files.update((name, (structure, lane.fetcher)) for name, structure in written.items())
            copied += copies
    copied += split_ep.whole_expert_copies(index, tag, sizes) + sorted(stage_copies, key=lambda c: c[1])
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
