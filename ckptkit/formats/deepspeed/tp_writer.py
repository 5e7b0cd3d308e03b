"""Write a native tensor-parallel DeepSpeed ZeRO-1/2/3 checkpoint for a new tp and dp
(`reshard --to tp=T,dp=W`; `--to N` keeps the source's tp).

The reader (join_tp.py) joins the source's mp ranks into full tensors and records each
parameter's split (`DeepSpeedNative.splits`: split dim, replicated, fused blocks). Here each new
mp rank t gets a *rank index* (tp_geometry.TpSlicer, from the geometry the reader joined with):
the full tensors under hidden keys, and under the usual keys (model.<name>,
optim.state.<name>.<key>, ds_module.<name>) rank t's slice of each, a virtual tensor whose pieces
are flat REF ranges of the full one (replicated tensors: the full entry).
With that index the ZeRO writer's cell (writer.cell_files: group_plan.py's partitions) lays rank
t's params out over W data-parallel ranks exactly as it re-partitions a plain ZeRO checkpoint,
bytes streamed from the source; the cell only names its mp rank and puts rank t's slices and
sizes in its model files. Files, as DeepSpeed 0.19 names and loads them (engine._load_checkpoint
reads mp rank t; _load_zero_checkpoint reads every optim_file(d, mp=t) file):
  model_file(t)                 rank t's module weights (sliced), param_shapes of its slices,
                                mp_world_size T, dp_world_size W, checkpoint_parallel_dimensions,
                                universal_checkpoint_info (AutoTP's affine_map redone for T)
  zero_model_file(d, t)
                                ZeRO 3 instead: one per (d, t), param_shapes of rank t's sub-groups
                                at W ranks (the ZeRO writer's stage-3 file), the sizes as above
  optim_file(d, bf16, mp=t)
                                partition d of W of rank t's flat groups (masters and states)
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

from ...context import RunContext
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from ...torch_types import Size
from ..torch_save.archive_writer import LazyTensor
from .layout import DeepSpeedLayout
from .group_plan import StatePlanner
from .info import ZeroGroup, ZeroInfo
from .native import DeepSpeedNative
from .templates import lazify, template_of
from .tag_writer import alignment, alignment_paddings, tag_name, write_tag, zero_config
from .autotp_cut import TpCut
from .tp_geometry import TpSlicer, affine_map_for
from .writer import DEFAULT_SUB_GROUP_SIZE, Cell, cell_files


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpTarget:
    tp: int
    dp: int
    shares: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # uneven cuts, by name


def target_sizes(index: CheckpointIndex, to: int | ParallelSizes) -> TpTarget:
    """(T, W) from `--to`: tp=T,dp=W, or a world size N that keeps the source's tp (W = N / tp)."""
    sizes = DeepSpeedLayout.of(index).resized(to, index.root)
    return TpTarget(tp=sizes.tp, dp=sizes.dp)


def write_tp_zero(
    out: Output, index: CheckpointIndex, source: Source, to: int | ParallelSizes, *, ctx: RunContext
) -> list[str]:
    """Reshard a tensor-parallel ZeRO checkpoint to T mp ranks of W dp ranks (module docstring)."""
    info: DeepSpeedNative = index.native
    target = target_sizes(index, to)
    zinfo: ZeroInfo = info.ranks[0]
    zero_cfg = zero_config(index)
    align = alignment(zero_cfg, zinfo.dtype)
    slicer = TpSlicer(index, info.splits, target.tp, TpCut(index, source, target.tp))
    target = dataclasses.replace(target, shares=slicer.uneven_shares())
    tag = tag_name(zinfo.files.tag, index)
    files: dict[str, tuple[Any, Fetcher]] = {}
    for t in range(target.tp):
        rank_index = slicer.rank_index(t, target.dp)
        fetcher = Fetcher(source, index=rank_index)
        local = dataclasses.replace(zinfo, groups=[local_group(g, rank_index, align) for g in zinfo.groups])
        structures = cell_files(
            rank_index,
            local,
            target.dp,
            tag,
            _sub_group_size(zero_cfg),
            StatePlanner(rank_index, fetcher),
            _lane_cell(t, zinfo, rank_index, target),
        )
        files.update((name, (structure, fetcher)) for name, structure in structures.items())
    return write_tag(out, source, tag, files, ctx, scripts=zinfo.files.tag is not None)


def _lane_cell(t: int, zinfo: ZeroInfo, rank_index: CheckpointIndex, target: TpTarget) -> Cell:
    """Tp rank t's ZeRO cell: its module slices, param_shapes and sizes in the model files."""

    def stage12_model(info: ZeroInfo, groups: list[ZeroGroup], world: int) -> dict:
        m0, marchive = template_of(zinfo, "model", min(zinfo.files.model_files))
        return _model(m0, marchive, rank_index, groups, target)

    return Cell(
        mp=t,
        stage12_model=stage12_model,
        stage3_model=lambda model: record_tp_sizes(model, target),
        label=lambda g: f"group {g.index} of mp rank {t}",
    )


def local_group(group: ZeroGroup, rank_index: CheckpointIndex, align: int) -> ZeroGroup:
    """The group with rank t's slice shapes (and DeepSpeed's alignment paddings for them)."""
    params = tuple((n, tuple(rank_index.tensors[f"model.{n}"].shape)) for n, _ in group.params)
    paddings = None
    if group.paddings is not None:
        paddings = tuple(alignment_paddings([s for _, s in params], align)) if align > 1 else group.paddings
    return dataclasses.replace(group, params=params, paddings=paddings)


def _sub_group_size(zero_cfg: Any) -> int | None:
    size = zero_cfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE) if isinstance(zero_cfg, dict) else None
    return int(size) if size is not None else None


def _model(m0: dict, marchive: Any, rank_index: CheckpointIndex, groups: list[ZeroGroup], target: TpTarget) -> dict:
    """Rank t's model-states file: the source rank 0's, with rank t's module slices and the new sizes."""
    model = module_slices(lazify(m0, marchive, {}), rank_index)
    if isinstance(model.get("param_shapes"), list):
        model["param_shapes"] = [OrderedDict((n, Size(s)) for n, s in g.params) for g in groups]
    return record_tp_sizes(model, target)


def module_slices(model: dict, rank_index: CheckpointIndex) -> dict:
    """The model file's dense module weights: the rank's slices (the same bytes at the source's tp)."""
    module = model.get("module")
    if isinstance(module, dict):
        model["module"] = type(module)(
            (k, LazyTensor(rank_index.tensors[f"ds_module.{k}"]) if f"ds_module.{k}" in rank_index.tensors else v)
            for k, v in module.items()
        )
    return model


def record_tp_sizes(model: dict, target: TpTarget) -> dict:
    """What DeepSpeed records of the sizes in a model-states file, for the new ones."""
    model["mp_world_size"] = target.tp
    model["dp_world_size"] = target.dp
    if isinstance(model.get("checkpoint_parallel_dimensions"), dict):
        model["checkpoint_parallel_dimensions"] = {**model["checkpoint_parallel_dimensions"], "tp_degree": target.tp}
    uc = model.get("universal_checkpoint_info")
    if isinstance(uc, dict) and isinstance(uc.get("affine_map"), dict):
        model["universal_checkpoint_info"] = affine_map_for(uc, target.tp, target.shares)
    return model
