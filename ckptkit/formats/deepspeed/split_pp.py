"""The writer's pp split: a lane's new pipeline stages, the identity without pipeline stages.

The reader joins each tp rank's stages into its pipeline (join_pp.py); the writer cuts a lane
(split_tp.py) into its new stages, each one ZeRO cell under model-parallel rank stage x tp + tp
rank. Stages come in the two variants the reader joins: a PipelineModule's layer-file stages
(pipeline_stages.py: layers assigned by `--partition-method` as PipelineModule does, each stage
one ZeRO-1 checkpoint over its own parameters) and a MoE PipelineModule's mp-rank stages
(moe_stages.py: each a MoE checkpoint of the layers it holds). Without stages the lane is one
cell: its own ZeRO record.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from ...errors import UnsupportedError, UsageError
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from . import moe_stages
from . import pipeline_stages as ps
from .info import ZeroGroup, ZeroInfo
from .layout import LAYER_FILES, NO_STAGES, DeepSpeedLayout
from .native import native_of
from .pipeline_partition import chosen_layer_types, chosen_partition_method
from .split_tp import Lane, layer_states
from .tag_writer import alignment, tag_name, zero_config
from .templates import template_of


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One (stage, tp rank) cell of the new layout: its model-parallel rank, the index and ZeRO
    record it is written from, and what a pipeline stage changes in its files (None: the lane's)."""

    mp: int
    index: CheckpointIndex
    info: ZeroInfo
    label: Callable[[ZeroGroup], str] | None = None  # a group in messages
    model: Callable[[], dict] | None = None  # a pipeline stage's stage 1/2 model-states file
    finish_optim: Callable | None = None  # what a pipeline stage adds to each optim file (writer.Cell)
    copied: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (source, output) files it copies


def stages(index: CheckpointIndex, lane: Lane, sizes: ParallelSizes) -> Iterator[Stage]:
    """The lane's new stages (module docstring); one, the lane itself, without pipeline stages."""
    layout = DeepSpeedLayout.of(index)
    if layout.stages == NO_STAGES:
        t = lane.rank
        label = None if lane.target is None else (lambda g: f"group {g.index} of mp rank {t}")
        yield Stage(mp=t, index=lane.index, info=lane.info, label=label)
    elif layout.stages == LAYER_FILES:
        yield from lane_stages(index, lane, sizes)
    else:
        yield from moe_lane_stages(index, lane, sizes)


def lane_stages(index: CheckpointIndex, lane: Lane, sizes: ParallelSizes) -> Iterator[Stage]:
    """A lane's new layer-file stages (module docstring), each under mp rank stage x tp + tp rank."""
    rank_index, native, t = lane.index, lane.native, lane.rank
    zinfo: ZeroInfo = native.stages[min(native.stages)]
    if lane.target is not None and "zero_stage" not in (
        zinfo.optim_states[min(zinfo.optim_states)].get("optimizer_state_dict") or {}
    ):
        raise UnsupportedError(
            f"{index.root}: a 3-D checkpoint written by BF16_Optimizer is not laid out at new "
            f"sizes yet (ZeRO stage 1 is)"
        )
    method = chosen_partition_method()
    layers, stage_of = ps.layer_table(rank_index)
    types = chosen_layer_types()
    if sizes.pp > max(len(layers), len(types or ())):
        raise UsageError(
            f"--to pp={sizes.pp}: {index.root} has {len(layers)} layers, fewer than the {sizes.pp} "
            f"pipeline stages asked for"
        )
    align = alignment(zero_config(index), zinfo.dtype)
    layers, parts = ps.new_stages(rank_index, layers, stage_of, method, sizes.pp, types)
    m0, marchive = template_of(zinfo, "model", min(zinfo.files.model_files))
    target = ps.PpTarget(pp=sizes.pp, dp=sizes.dp)
    for plan in ps.stage_plans(rank_index, layers, parts, align):
        ps.check_trainable(plan, sizes.pp)
        s = plan.stage
        yield Stage(
            mp=s * sizes.tp + t,
            index=rank_index,
            info=ps.stage_info(zinfo, plan),
            label=(lambda g, s=s: f"group {g.index} of pipeline stage {s}")
            if lane.target is None
            else (lambda g, s=s: f"group {g.index} of stage {s}, tp rank {t}"),
            model=lambda plan=plan: ps.stage_model(m0, marchive, plan, target),
            finish_optim=ps.stage_optim(zinfo, plan),
        )


def moe_lane_stages(index: CheckpointIndex, lane: Lane, sizes: ParallelSizes) -> Iterator[Stage]:
    """A MoE PipelineModule's new mp-rank stages (moe_stages.py): each a MoE checkpoint of the
    layers it holds, its template joined from the source stages, its expert files renamed."""
    if lane.target is not None:
        raise UnsupportedError(
            f"--to {sizes}: adding tensor parallelism to the mixture-of-experts PipelineModule "
            f"checkpoint {index.root} is not supported yet"
        )
    parts = moe_stages.new_parts(index, sizes.pp, sizes.ep)
    align = alignment(zero_config(index), native_of(index).cell().dtype)
    layer_ids = moe_stages.source_layer_ids(index)  # (source stage, L) -> MoE prefix
    tag = tag_name(native_of(index).cell().files.tag, index)
    for s in range(sizes.pp):
        zinfo, counts = moe_stages.stage_template(index, range(parts[s], parts[s + 1]), s, sizes.pp, align)
        moe = {**index.metadata["deepspeed_moe"], "num_experts": counts}
        stage_index = dataclasses.replace(index, metadata={**index.metadata, "deepspeed_moe": moe})
        yield Stage(mp=s, index=stage_index, info=zinfo, copied=moe_stages.stage_copies(layer_ids, s, counts, tag))


def lane_files(index: CheckpointIndex, lane: Lane, tag: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A pipeline lane's layer files: (written, copied). Kept whole (no tp on either side) each
    is copied byte for byte (a layer's own state under local names does not depend on the stage
    holding it); a tp lane's are its slices (split_tp.layer_states)."""
    if DeepSpeedLayout.of(index).stages != LAYER_FILES:
        return {}, []
    if lane.target is not None:
        return layer_states(index, lane, tag), []
    layer_files = native_of(index).layer_files
    return {}, [(rel, f"{tag}/{rel.rpartition('/')[2]}") for _, rel in sorted(layer_files.items())]
