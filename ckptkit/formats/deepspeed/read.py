"""The one DeepSpeed reader: each (stage, tp rank) cell read as a ZeRO checkpoint, then joined.

Whatever the parallel layout, a DeepSpeed checkpoint is a grid of ordinary ZeRO checkpoints, one
per model-parallel rank (stage x tp + tp rank). The reader reads each cell (reader.py; a
PipelineModule's stage with its layer files, pipeline.py), then joins them over ep, pp and tp in
that order, each join the identity when its size is 1:

- ep: experts sliced over the tp ranks (or at tp 1) are joined inside each cell as it is read
  (moe.py); whole experts (`enable_expert_tensor_parallelism=False`) span the tp ranks and are
  joined over the tp-joined index (join_ep.py), the one join that comes last;
- pp: each tp rank's stages into its pipeline (join_pp.py: layer-file stages merged by name with
  their tied modules, or a MoE PipelineModule's mp-rank stages);
- tp: the tp ranks' lanes into full tensors (join_tp.py).

The grid (its sizes and which variant names its stages) comes from the files: layer files name
the tp ranks and the stages (pipeline.lane_grid), else the mp ranks are stages when the first
cell records a pipeline (join_pp.recorded_pp), tp ranks otherwise. The index's native record
(native.py's `DeepSpeedNative`) is built once, here, from the cells and what the joins found.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...convert.tp_rules import TpRules, TpSplit, chosen_rules_file, load_rules
from ...index.types import CheckpointIndex
from ...storage.source import Source
from . import join_ep, join_pp, join_tp, pipeline, reader
from .files import ZeroFiles, locate
from .info import ZeroInfo
from .layout import MP_RANK_STAGES, DeepSpeedLayout
from .native import Copies, DeepSpeedNative, PipelineLane, layout_read


@dataclass(kw_only=True)
class Lane:
    """One tp rank's stages joined over pp: its index and each stage's ZeRO record."""

    index: CheckpointIndex
    cells: dict[int, ZeroInfo]  # stage -> ZeroInfo
    pipeline: PipelineLane | None = None  # layer-file stages: the layer files' facts
    stage_experts: dict[int, dict[str, int]] = field(default_factory=dict)  # mp-rank stages: experts per stage


def read_index(
    source: Source, tag: str | None = None, tp_rules: TpRules | None = None, *, optimizer: bool = True
) -> CheckpointIndex:
    """The checkpoint's index. A tensor-parallel one is joined into full tensors, their splits
    decided by what the checkpoint records, then `tp_rules` (default: the --tp-rules file, then
    the built-in rules). `optimizer` False (the weights alone are wanted): a plain ZeRO
    checkpoint's optimizer state is read and checked but its per-parameter entries only counted;
    parallel and expert checkpoints are indexed whole regardless."""
    layer_stages = pipeline.detect(source, tag)
    if layer_stages:
        pipeline.check_tag(source, tag)
    files = locate(source, tag)
    label = source.label(files.prefix + (files.model_files[min(files.model_files)] if files.model_files else ""))
    if layer_stages:
        grid = pipeline.lane_grid(source, files, label)
        lanes = {t: _layer_file_lane(source, files, grid, t) for t in range(grid.tp)}
    else:
        grid, cells = _zero_cells(source, files, optimizer)
        lanes = {t: _rank_stage_lane(source, files, grid, cells, t) for t in range(grid.tp)}
    if grid.tp > 1:
        rules = tp_rules if tp_rules is not None else load_rules(chosen_rules_file())
        index, splits, copies = join_tp.join(source, files, grid, _indexes(lanes), lanes[0].cells[0], rules, label)
    else:
        index, splits, copies = lanes[0].index, {}, {}
    if files.whole_experts:  # each expert whole on one mp rank: joined over ep across the tp ranks
        join_ep.join(source, files, index, {t: lane.cells[0] for t, lane in lanes.items()})
    index.native = _native(index, grid, lanes, splits, copies)
    return index


def _layer_file_lane(source: Source, files: ZeroFiles, grid: DeepSpeedLayout, tp_rank: int) -> Lane:
    """tp rank `tp_rank`'s PipelineModule stages, each read with its layer files, joined over pp."""
    index, cells, layer_files = pipeline.read_lane(source, files, grid, tp_rank)
    return Lane(index=index, cells=cells, pipeline=layer_files)


def _zero_cells(
    source: Source, files: ZeroFiles, optimizer: bool
) -> tuple[DeepSpeedLayout, dict[tuple[int, int], tuple[CheckpointIndex, ZeroInfo]]]:
    """Each mp rank's files read as a ZeRO checkpoint, placed in the grid: the mp ranks are a MoE
    PipelineModule's stages when the first cell records a pipeline, else tp ranks."""
    if not files.model_parallel:
        return DeepSpeedLayout(), {(0, 0): reader.read_zero(source, files, optimizer=optimizer)}
    read = {mp: reader.read_zero(source, mp_files) for mp, mp_files in sorted(files.model_parallel.items())}
    if join_pp.recorded_pp(read[0][0]) is None:
        grid = DeepSpeedLayout(tp=len(read))
    else:
        grid = DeepSpeedLayout(pp=len(read), stages=MP_RANK_STAGES)
    return grid, {grid.cell(mp): cell for mp, cell in read.items()}


def _rank_stage_lane(
    source: Source,
    files: ZeroFiles,
    grid: DeepSpeedLayout,
    cells: dict[tuple[int, int], tuple[CheckpointIndex, ZeroInfo]],
    tp_rank: int,
) -> Lane:
    """tp rank `tp_rank`'s cells joined over pp: the identity at pp 1, else a MoE PipelineModule's
    mp-rank stages joined by name (join_pp.join_rank_stages)."""
    stages = {s: cells[(s, tp_rank)] for s in range(grid.pp)}
    if grid.pp == 1:
        index, info = stages[0]
        return Lane(index=index, cells={0: info})
    index, experts = join_pp.join_rank_stages(source, files, {s: index for s, (index, _) in stages.items()})
    return Lane(index=index, cells={s: info for s, (_, info) in stages.items()}, stage_experts=experts)


def _indexes(lanes: dict[int, Lane]) -> dict[int, CheckpointIndex]:
    return {t: lane.index for t, lane in lanes.items()}


def _native(
    index: CheckpointIndex,
    grid: DeepSpeedLayout,
    lanes: dict[int, Lane],
    splits: dict[str, TpSplit],
    copies: Copies,
) -> DeepSpeedNative:
    """The one native record: every (stage, tp rank) cell, what the joins found, the layout."""
    cells = {(s, t): info for t, lane in lanes.items() for s, info in lane.cells.items()}
    pipelines = {t: lane.pipeline for t, lane in lanes.items() if lane.pipeline is not None}
    return DeepSpeedNative(
        layout=layout_read(index, cells, pipelines, mp_rank_stages=grid.stages == MP_RANK_STAGES),
        cells=cells,
        splits=splits,
        tp_copies=copies,
        lanes=pipelines,
        stage_experts=lanes[0].stage_experts,
    )
