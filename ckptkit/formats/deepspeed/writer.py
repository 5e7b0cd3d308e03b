"""Write a native (rigid, not universal) DeepSpeed ZeRO checkpoint for a new world size.

Same stage and precision as the source. Everything DeepSpeed's loader and its own tools read is
recomputed for M ranks: partition sizes and paddings, fp32 partitions and every optimizer state
partitioned with them, whatever the optimizer (exp_avg, momentum_buffer, sum, square_avg...: as
virtual slices of the per-parameter tensors, streamed), stage-3 sub-groups and frozen fragments,
param_shapes, partition_count, param_slice_mappings, group_paddings, dp_world_size. Everything
else (scheduler, loss scaler, client state, config) is carried over unchanged, the DeepSpeed
classes re-emitted as themselves; optimizer state kept whole (an int step, torch's 0-d step
tensor) is each group's one value, of the same type and dtype.

`cell_files` writes one such checkpoint; the parallel writers write each of their cells (a tp
lane, a pipeline stage, a (stage, tp rank)) with it, a `Cell` naming its model-parallel rank and
what its model and optim files add. A cell of a mixture-of-experts model also says how its expert
groups are split (`ExpertSplit`): each over the ranks of one expert-parallel rank, not over all.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from ...context import RunContext
from ...errors import FormatError, UnsupportedError
from ...index.state_keys import model_key
from ...index.types import CheckpointIndex
from ...index.virtual import Part
from ...repickle import stand_in
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from ...torch_types import Size
from ...runner.torch_archive import Archive
from . import partition, standins
from .names import model_file, optim_file, zero_model_file
from .group_plan import GroupPlan, StatePlanner, plan_group, state_templates, target_groups, virtual
from .info import ZeroGroup, ZeroInfo, stage_names
from .layout import DeepSpeedLayout
from .native import native_of
from .refusals import refuse_experts, refuse_tensor_parallel
from .tag_writer import tag_name, write_tag, zero_config
from .templates import lazify, ordered_like, template_of

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


def write_zero(out: Output, index: CheckpointIndex, source: Source, world_size: int, *, ctx: RunContext) -> list[str]:
    """Reshard: the source's own files, recomputed for `world_size` ranks."""
    refuse_experts(index)  # expert groups partitioned over expert-data-parallel ranks: not laid out yet
    if index.native is None:
        raise FormatError("write_zero needs a DeepSpeed checkpoint read by ckptkit")
    refuse_tensor_parallel(index)  # per-mp-rank layouts: reshard --to tp=... lays them out
    if DeepSpeedLayout.of(index).family != "zero":
        raise FormatError("write_zero needs a DeepSpeed checkpoint read by ckptkit")
    info = native_of(index).cell()
    zero_cfg = zero_config(index)
    sub_group_size = zero_cfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    return write_zero_files(
        out,
        index,
        source,
        info,
        world_size,
        tag_name(info.files.tag, index),
        int(sub_group_size) if sub_group_size is not None else None,
        ctx=ctx,
        scripts=info.files.tag is not None,
    )


def write_zero_files(
    out: Output,
    index: CheckpointIndex,
    source: Source,
    info: ZeroInfo,
    world_size: int,
    tag: str,
    sub_group_size: int | None,
    *,
    ctx: RunContext,
    scripts: bool = False,
) -> list[str]:
    """`latest` and the tag's model/optim files for `world_size` ranks, from `info`'s templates
    (a source checkpoint's own structures, or ones convert built from a DeepSpeed config);
    `scripts`: also copy the source's DeepSpeed helper scripts."""
    fetcher = Fetcher(source, index=index)
    files = cell_files(index, info, world_size, tag, sub_group_size, StatePlanner(index, fetcher))
    return write_tag(out, source, tag, {n: (s, fetcher) for n, s in files.items()}, ctx, scripts=scripts)


@dataclass(frozen=True)
class ExpertSplit:
    """How a cell's expert groups are partitioned (DeepSpeed's expert-data-parallel groups). Cell
    rank d is global rank lane + stride * d (stride: the tp size when whole experts span the tp x
    dp ranks, else 1), expert-parallel rank g % ep and partition g // ep of `partitions`, holding
    that ep rank's experts."""

    ep: int
    # group index -> per expert-parallel rank: the group's params (index names) and their names
    # on that rank (its local expert ids)
    groups: dict[int, list[tuple[ZeroGroup, dict[str, str]]]]
    paddings: dict[int, list[int]]  # group index -> its param_alignment_paddings at `ep`
    partitions: int
    lane: int = 0
    stride: int = 1

    def place(self, rank: int) -> tuple[int, int]:
        """(expert-parallel rank, partition) of cell rank `rank`."""
        g = self.lane + self.stride * rank
        return g % self.ep, g // self.ep


@dataclass(frozen=True)
class RankPart:
    """What one rank writes of one group: the plan, which of its partitions, of how many, and the
    names its param_slice_mappings give (index name -> the rank's own; missing: the same)."""

    plan: GroupPlan
    part: int
    count: int
    local: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Cell:
    """Where one ZeRO checkpoint sits in a parallel layout: its model-parallel rank `mp`, how its
    model-states files differ from a plain checkpoint's, and what messages call its groups. The
    default is a plain checkpoint (mp rank 0, the source's model file at the new dp size)."""

    mp: int = 0
    stage12_model: Callable[[ZeroInfo, list[ZeroGroup], int], dict] | None = None  # (info, groups, world)
    stage3_model: Callable[[dict], dict] | None = None  # what the cell changes in each rank's file
    label: Callable[[ZeroGroup], str] | None = None  # a group in messages (default: "group 3")
    # stage 1/2: what the cell adds to rank r's optimizer_state_dict (osd, r, plans, the model file)
    finish_optim: Callable[[dict, int, list[GroupPlan], dict], dict] | None = None
    experts: ExpertSplit | None = None  # stage 1/2: the expert groups, each split over its ep rank's ranks


PLAIN = Cell()


def cell_files(
    index: CheckpointIndex,
    info: ZeroInfo,
    world: int,
    tag: str,
    sub_group_size: int | None,
    states: StatePlanner,
    cell: Cell = PLAIN,
) -> dict[str, Any]:
    """relative name -> structure of every model and optim-states file of one cell, in DeepSpeed's order."""
    names = stage_names(info.stage)
    groups = target_groups(info, world, sub_group_size)
    files: dict[str, Any] = {}
    model12: dict = {}
    if info.stage < 3:
        model12 = files[f"{tag}/{model_file(cell.mp)}"] = (cell.stage12_model or stage12_model)(info, groups, world)
    o0, oarchive = template_of(info, "optim", 0)
    osd_t = o0["optimizer_state_dict"]
    if info.stage == 3 and "ds_zero_partition_groups" in osd_t:
        raise UnsupportedError("ZeRO-3 checkpoints with expert partition groups are not supported yet")
    templates = state_templates(info.stage, osd_t[names.optimizer]["state"], groups)
    label = cell.label or (lambda group: f"{names.group} {group.index}")
    split = cell.experts
    plans = [
        plan_group(index, states, info.stage, group, template, oarchive, label(group), world)
        for group, template in zip(groups, templates)
        if split is None or group.index not in split.groups
    ]
    expert_plans = _expert_plans(index, states, info.stage, split, osd_t[names.optimizer]["state"], oarchive, label)
    shared: dict = {}  # the ranks' model-states files share their template's lazy tensors and param_shapes
    for rank in range(world):
        if info.stage == 3:
            model = stage3_model(index, info, groups, world, rank, shared)
            files[f"{tag}/{zero_model_file(rank, cell.mp)}"] = cell.stage3_model(model) if cell.stage3_model else model
        if info.stage < 3:
            osd = stage12_optim(osd_t, oarchive, _rank_parts(plans, expert_plans, split, rank, world), world, split)
        else:
            osd = stage3_optim(osd_t, oarchive, plans, rank, world)
        if cell.finish_optim is not None:
            osd = cell.finish_optim(osd, rank, plans, model12)
        top = {k: lazify(v, oarchive, {}) for k, v in o0.items() if k != "optimizer_state_dict"}
        files[f"{tag}/{optim_file(rank, info.files.bf16_prefix, mp=cell.mp)}"] = {"optimizer_state_dict": osd, **top}
    return files


def _expert_plans(
    index: CheckpointIndex,
    states: StatePlanner,
    stage: int,
    split: ExpertSplit | None,
    template_state: Any,
    oarchive: Archive | None,
    label: Callable[[ZeroGroup], str],
) -> dict[int, list[tuple[GroupPlan, dict[str, str]]]]:
    """group index -> per expert-parallel rank: its plan over `split.partitions` ranks (from the
    group's state in the template), its local names."""
    if split is None:
        return {}
    templates = template_state if isinstance(template_state, dict) else {}
    return {
        i: [
            (plan_group(index, states, stage, group, templates.get(i), oarchive, label(group), split.partitions), local)
            for group, local in lanes
        ]
        for i, lanes in split.groups.items()
    }


def _rank_parts(
    plans: list[GroupPlan],
    expert_plans: dict[int, list[tuple[GroupPlan, dict[str, str]]]],
    split: ExpertSplit | None,
    rank: int,
    world: int,
) -> list[RankPart]:
    """Rank `rank`'s part of every group, in group order: partition `rank` of `world` of a dense
    group; of an expert group, its ep rank's plan and partition (ExpertSplit.place)."""
    parts = {plan.group.index: RankPart(plan, rank, world) for plan in plans}
    if split is not None:
        ep_rank, part = split.place(rank)
        for i, lanes in expert_plans.items():
            plan, local = lanes[ep_rank]
            parts[i] = RankPart(plan, part, split.partitions, local)
    return [parts[i] for i in sorted(parts)]


def stage12_model(info: ZeroInfo, groups: list[ZeroGroup], world: int) -> dict:
    """Stage 1/2's one model-states file: the source's, with the new world size."""
    m0, marchive = template_of(info, "model", min(info.files.model_files))
    model = lazify(m0, marchive, {})
    model["dp_world_size"] = world
    return model


def stage3_model(
    index: CheckpointIndex, info: ZeroInfo, groups: list[ZeroGroup], world: int, rank: int, shared: dict | None = None
) -> dict:
    """Stage 3's model-states file of `rank`: the new sub-groups' shapes, its slice of each frozen param.
    `shared` (one dict for all ranks' calls, never mutated by the files) keeps the template's
    lazified values (lazy tensors, the module's dict) and the param_shapes, built once instead of
    once per rank (a module of 20k parameters has 20k placeholder tensors)."""
    m_t, marchive = template_of(info, "model", 0)
    model = shared.get("model") if shared is not None else None
    if model is None:
        model = lazify(m_t, marchive, {})
        if shared is not None:
            shared["model"] = model
    model = copy.copy(model)  # the top level is each rank's own; what it holds is shared (never mutated)
    model["dp_world_size"] = world
    shapes = shared.get("param_shapes") if shared is not None else None
    if shapes is None:
        shapes = [OrderedDict((n, Size(s)) for n, s in grp.params) for grp in groups]
        if shared is not None:
            shared["param_shapes"] = shapes
    model["param_shapes"] = shapes
    held = model.get("shared_params")
    if rank != 0 or (type(held) is dict and not held):  # only rank 0 keeps the tied params; one empty dict
        # for all the others (and rank 0's when it is one): their files then pickle alike (tag_writer._alike)
        model["shared_params"] = shared.setdefault("no_shared_params", {}) if shared is not None else {}
    if info.frozen:
        frags = OrderedDict()
        for name, shape in info.frozen.items():
            numel = math.prod(shape)
            per = partition.stage3_slice(numel, world)
            entry = index.tensors[model_key(name)]
            frags[name] = virtual(
                f"frozen.{name}.{rank}", entry.dtype, [Part(model_key(name), 0, numel)], rank * per, per
            )
        model["frozen_param_fragments"] = frags
    return model


# the entries of a stage 1/2 optimizer_state_dict rebuilt for the new size (one item per group)
REBUILT12 = ("base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings", "partition_count")


def stage12_optim(
    osd_t: dict, oarchive: Archive | None, parts: list[RankPart], world: int, split: ExpertSplit | None = None
) -> dict:
    """Stage 1/2's optimizer_state_dict of one rank (its `parts`, one per group), with DeepSpeed's
    bookkeeping for the new size; with expert groups (`split`), their partition counts, names
    (`ep_size_<ep>`, as the engine names its expert groups) and alignment paddings too."""
    rebuilt = REBUILT12 + ("param_slice_mappings",) + (("param_alignment_paddings",) if split is not None else ())
    osd: dict = {key: lazify(value, oarchive, {}) for key, value in osd_t.items() if key not in rebuilt}
    state, fp32, paddings, mappings = {}, [], [], []
    for item in parts:
        share = item.plan.shares[item.part]
        fp32.append(item.plan.masters(item.part))
        if item.plan.has_state:
            state[item.plan.group.index] = item.plan.state(item.part)
        paddings.append(share.end_padding)  # DeepSpeed's own bookkeeping of the end padding
        mappings.append(
            OrderedDict(
                (
                    item.local.get(slot.name, slot.name),
                    stand_in(standins.FRAGMENT_ADDRESS, numel=slot.length, start=slot.position),
                )
                for slot in share.slots
            )
        )
    param_groups = copy.deepcopy(osd_t["base_optimizer_state"]["param_groups"])
    for i in split.groups if split is not None else ():
        param_groups[i]["name"] = f"ep_size_{split.ep}"  # the engine's expert group names it so
    osd["base_optimizer_state"] = {"state": state, "param_groups": param_groups}
    osd["single_partition_of_fp32_groups"] = fp32
    osd["group_paddings"] = paddings
    pc = osd_t.get("partition_count")
    if split is not None:
        osd["partition_count"] = [item.count for item in parts]
    else:
        osd["partition_count"] = [world] * len(pc) if isinstance(pc, list) else world
    osd["param_slice_mappings"] = mappings
    if split is not None and "param_alignment_paddings" in osd_t:
        osd["param_alignment_paddings"] = [
            list(split.paddings[i]) if i in split.paddings else copy.deepcopy(osd_t["param_alignment_paddings"][i])
            for i in range(len(parts))
        ]
    return ordered_like(osd_t, osd)


def stage3_optim(osd_t: dict, oarchive: Archive | None, plans: list[GroupPlan], rank: int, world: int) -> dict:
    """Stage 3's optimizer_state_dict of `rank`: each param group names its new sub-groups."""
    state, flats = {}, []
    groups_params: dict[int, list[int]] = {}
    for i, plan in enumerate(plans):
        groups_params.setdefault(plan.group.param_group, []).append(i)
        flats.append(plan.masters(rank))
        if plan.has_state:
            state[i] = plan.state(rank)
    param_groups = copy.deepcopy(osd_t["optimizer_state_dict"]["param_groups"])
    for g, meta in enumerate(param_groups):
        meta["params"] = groups_params.get(g, [])
    osd = {}
    for key, value in osd_t.items():
        if key == "optimizer_state_dict":
            osd[key] = {"state": state, "param_groups": param_groups}
        elif key == "fp32_flat_groups":
            osd[key] = flats
        elif key == "partition_count":
            osd[key] = world
        else:
            osd[key] = lazify(value, oarchive, {})
    return osd
