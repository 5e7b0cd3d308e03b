"""Write a native DeepSpeed mixture-of-experts checkpoint (`deepspeed.moe.layer.MoE`, ZeRO 1/2) for a
new expert-parallel size E' and data-parallel world size W' (`reshard --to ep=E',dp=W'`).

What DeepSpeed 0.19 loads (engine._load_checkpoint, load_moe_state_dict, _load_zero_checkpoint,
stage_1_and_2._load_legacy_checkpoint). Global rank r is expert-parallel rank r % E' and
expert-data-parallel rank r // E' (DeepSpeed's default E + D order, as moe.py reads it):
  model_file(0)                the dense module and num_experts as saved; dp_world_size W' (the
                               loader reads that many optim files); param_shapes naming ep rank
                               0's local experts at E'
  expert_file(L, G, 0)
                               expert G under its global name: the same at every E', copied byte
                               for byte (each rank loads its local experts' files and renames them)
  optim_file(r, bf16, mp=0)
                               read by rank r alone: partition r of W' of each dense group, and of
                               each expert group partition r // E' of W'/E', holding ep rank
                               r % E''s experts under their LOCAL ids (param_slice_mappings),
                               partition_count W' or W'/E' per group, the group named ep_size_<E'>
                               (torch's load_state_dict restores the saved group names) and
                               param_alignment_paddings as the engine computes them (it refuses others)
Values come from the index (global names) through the ZeRO writer's group plans (group_plan.py):
fp32 masters and every optimizer state sliced lazily, whole values (the step) kept as they were.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ...context import RunContext
from ...errors import UnsupportedError
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...repickle import stand_in
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from ...torch_types import Size
from . import standins
from .entries import shape_of
from .layout import DeepSpeedLayout
from .names import model_file, optim_file
from .group_plan import GroupPlan, StatePlanner, plan_group
from .info import ZeroGroup, ZeroInfo
from .moe import MARK, split_expert_name
from .refusals import refuse_pipeline_moe
from .tag_writer import alignment, alignment_paddings, tag_name, write_tag, zero_config
from .templates import lazify, ordered_like, template_of

# split_params_into_different_moe_groups_for_optimizer's default: a larger expert group is split
MAX_GROUP_SIZE = 178956971


@dataclass(frozen=True, kw_only=True)
class MoeTarget:
    """The new sizes: E' expert-parallel ranks among W' data-parallel ranks."""

    ep: int
    world: int

    @property
    def edp(self) -> int:
        return self.world // self.ep


def target_sizes(index: CheckpointIndex, to: int | ParallelSizes) -> MoeTarget:
    """(E', W') from `--to`, checked against every MoE layer's expert count; a plain world size keeps
    the source's E when it divides it."""
    sizes = DeepSpeedLayout.of(index).resized(to, index.root)
    return MoeTarget(ep=sizes.ep, world=sizes.dp)


@dataclass(frozen=True, kw_only=True)
class ExpertGroupShape:
    """One expert param group as the model lays it out: per MoE layer (in order) the parameters of
    one expert (in order, with shapes); every local expert repeats them."""

    index: int
    param_group: int
    layers: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...]

    def params(self, locals_: dict[str, int], ep_rank: int, local_names: bool) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) in flat-buffer order for `ep_rank` with `locals_[prefix]` experts per rank;
        names with local ids (DeepSpeed's param names on that rank) or global ones (the index's)."""
        out = []
        for prefix, rests in self.layers:
            n = locals_[prefix]
            for local in range(n):
                expert = local if local_names else local + ep_rank * n
                out += [(f"{prefix}{MARK}{expert}.{rest}", shape) for rest, shape in rests]
        return out


def expert_group_shape(
    index: int, param_group: int, shapes: list[tuple[str, tuple[int, ...]]], locals_: dict[str, int], where: str
) -> ExpertGroupShape:
    """The layout of an expert group from rank 0's param_shapes (local names), checked to be
    layer by layer, expert by expert, as MoE's named_parameters give them."""
    layers: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in shapes:
        prefix, local, rest = split_expert_name(name, where)
        if local == 0:
            layers.setdefault(prefix, []).append((rest, tuple(shape)))
    found = ExpertGroupShape(
        index=index, param_group=param_group, layers=tuple((p, tuple(r)) for p, r in layers.items())
    )
    if [(n, tuple(s)) for n, s in shapes] != found.params({p: locals_[p] for p in layers}, 0, local_names=True):
        raise UnsupportedError(
            f"{where}: the experts of group {index} are not laid out layer by layer, expert by "
            f"expert with the same parameters each (as deepspeed.moe.layer.MoE's are); "
            f"resharding it is not supported"
        )
    return found


def write_moe_zero(
    out: Output, index: CheckpointIndex, source: Source, to: int | ParallelSizes, *, ctx: RunContext
) -> list[str]:
    """Reshard a MoE ZeRO-1/2 checkpoint to E' expert-parallel ranks among W' ranks (module docstring)."""
    refuse_pipeline_moe(index)  # a MoE PipelineModule: its stages are not laid out yet
    info: ZeroInfo = index.native
    target = target_sizes(index, to)
    zero_cfg = zero_config(index)
    tag = tag_name(info.files.tag, index)
    fetcher = Fetcher(source, index=index)
    files = moe_files(index, info, target, tag, zero_cfg, StatePlanner(index, fetcher))
    copied = [(info.files.prefix + name, f"{tag}/{name}") for name in sorted(info.files.expert_files)]
    return write_tag(
        out,
        source,
        tag,
        {n: (s, fetcher) for n, s in files.items()},
        ctx,
        copied=copied,
        scripts=info.files.tag is not None,
    )


@dataclass(frozen=True, kw_only=True)
class _RankGroup:
    """What rank r writes of one group: the plan, its part of it, and DeepSpeed's bookkeeping."""

    plan: GroupPlan
    part: int  # the partition index within the group's data-parallel ranks
    count: int  # partition_count
    local: dict[str, str]  # index (global) name -> the rank's param name


def moe_files(
    index: CheckpointIndex, info: ZeroInfo, target: MoeTarget, tag: str, zero_cfg: dict, states: StatePlanner
) -> dict[str, Any]:
    meta = index.metadata["deepspeed_moe"]
    ep_src, counts = int(meta["ep_size"]), dict(meta["num_experts"])
    src_locals = {p: n // ep_src for p, n in counts.items()}
    new_locals = {p: n // target.ep for p, n in counts.items()}
    m0, marchive = template_of(info, "model", min(info.files.model_files))
    o0, oarchive = template_of(info, "optim", min(info.files.optim_files))
    osd_t = o0["optimizer_state_dict"]
    groups_meta = osd_t["base_optimizer_state"]["param_groups"]
    m_label = f"{index.root}: {info.files.prefix}{info.files.model_files[min(info.files.model_files)]}"
    dense = {g.index: g for g in info.groups if not _is_expert(groups_meta, g.param_group)}
    expert_ids = [i for i in range(len(groups_meta)) if _is_expert(groups_meta, i)]
    shapes = [
        [(n, shape_of(s, f"{m_label}: param_shapes[{g}][{n}]")) for n, s in ps.items()]
        for g, ps in enumerate(m0["param_shapes"])
    ]
    layouts = {i: expert_group_shape(i, i, shapes[i], src_locals, m_label) for i in expert_ids}
    align = alignment(zero_cfg, info.dtype)
    paddings_t = osd_t.get("param_alignment_paddings")
    for i in expert_ids:
        if (
            isinstance(paddings_t, list)
            and i < len(paddings_t)
            and list(paddings_t[i]) != alignment_paddings([s for _, s in shapes[i]], align)
        ):
            raise UnsupportedError(
                f"{m_label}: the alignment paddings of expert group {i} are not the ones "
                f"DeepSpeed computes; resharding it is not supported"
            )
    templates = osd_t["base_optimizer_state"]["state"]
    plans: dict[int, list[_RankGroup]] = {}  # group -> one per target rank
    for i, group in sorted(dense.items()):
        plan = plan_group(index, states, info.stage, group, templates.get(i), oarchive, f"group {i}", target.world)
        plans[i] = [_RankGroup(plan=plan, part=r, count=target.world, local={}) for r in range(target.world)]
    new_paddings: dict[int, list[int]] = {}
    for i in expert_ids:
        per_ep = []
        for e in range(target.ep):
            glob = layouts[i].params(new_locals, e, local_names=False)
            local = layouts[i].params(new_locals, e, local_names=True)
            numel = sum(math.prod(s) for _, s in glob)
            if numel > MAX_GROUP_SIZE:
                raise UnsupportedError(
                    f"{m_label}: expert group {i} would hold {numel} elements per rank at "
                    f"ep={target.ep}, more than DeepSpeed's max_group_size {MAX_GROUP_SIZE}, which splits it into "
                    f"several groups; resharding to fewer expert-parallel ranks than that is not "
                    f"supported yet"
                )
            new_paddings[i] = alignment_paddings([s for _, s in glob], align)
            group = ZeroGroup(
                index=i,
                param_group=i,
                params=tuple(glob),
                paddings=tuple(new_paddings[i]) if any(new_paddings[i]) else None,
            )
            per_ep.append(
                (
                    plan_group(index, states, info.stage, group, templates.get(i), oarchive, f"group {i}", target.edp),
                    {g: n for (g, _), (n, _) in zip(glob, local)},
                )
            )
        plans[i] = [
            _RankGroup(
                plan=per_ep[r % target.ep][0], part=r // target.ep, count=target.edp, local=per_ep[r % target.ep][1]
            )
            for r in range(target.world)
        ]
    files: dict[str, Any] = {f"{tag}/{model_file(0)}": _model(m0, marchive, shapes, layouts, new_locals, target)}
    order = sorted(plans)
    for r in range(target.world):
        osd = _optim(osd_t, oarchive, [plans[i][r] for i in order], groups_meta, expert_ids, new_paddings, target)
        top = {k: lazify(v, oarchive, {}) for k, v in o0.items() if k != "optimizer_state_dict"}
        files[f"{tag}/{optim_file(r, info.files.bf16_prefix)}"] = {"optimizer_state_dict": osd, **top}
    return files


def _is_expert(groups_meta: list, i: int) -> bool:
    return isinstance(groups_meta[i], dict) and bool(groups_meta[i].get("moe"))


def _model(
    m0: dict,
    marchive: Any,
    shapes: list,
    layouts: dict[int, ExpertGroupShape],
    new_locals: dict[str, int],
    target: MoeTarget,
) -> dict:
    """The one model-states file: the source's, with W' and ep rank 0's local experts at E'."""
    model = lazify(m0, marchive, {})
    model["dp_world_size"] = target.world
    param_shapes = list(model["param_shapes"])
    for i, layout in layouts.items():
        saved = {split_expert_name(n)[::2]: v for n, v in param_shapes[i].items()}  # keep the saved shape type
        param_shapes[i] = OrderedDict(
            (n, saved.get(split_expert_name(n)[::2], Size(s)))
            for n, s in layout.params(new_locals, 0, local_names=True)
        )
    model["param_shapes"] = param_shapes
    return model


def _optim(
    osd_t: dict,
    oarchive: Any,
    groups: list[_RankGroup],
    groups_meta: list,
    expert_ids: list[int],
    new_paddings: dict[int, list[int]],
    target: MoeTarget,
) -> dict:
    """One rank's optimizer_state_dict: each group's partition with DeepSpeed's bookkeeping."""
    osd: dict = {}
    for key, value in osd_t.items():
        if key in (
            "base_optimizer_state",
            "single_partition_of_fp32_groups",
            "group_paddings",
            "partition_count",
            "param_slice_mappings",
            "param_alignment_paddings",
        ):
            continue
        osd[key] = lazify(value, oarchive, {})
    state, fp32, paddings, mappings = {}, [], [], []
    for item in groups:
        share = item.plan.shares[item.part]
        fp32.append(item.plan.masters(item.part))
        if item.plan.has_state:
            state[item.plan.group.index] = item.plan.state(item.part)
        paddings.append(share.end_padding)
        mappings.append(
            OrderedDict(
                (
                    item.local.get(slot.name, slot.name),
                    stand_in(standins.FRAGMENT_ADDRESS, numel=slot.length, start=slot.position),
                )
                for slot in share.slots
            )
        )
    param_groups = copy.deepcopy(groups_meta)
    for i in expert_ids:
        param_groups[i]["name"] = f"ep_size_{target.ep}"  # the engine's expert group names it so
    osd["base_optimizer_state"] = {"state": state, "param_groups": param_groups}
    osd["single_partition_of_fp32_groups"] = fp32
    osd["group_paddings"] = paddings
    osd["partition_count"] = [item.count for item in groups]
    osd["param_slice_mappings"] = mappings
    if "param_alignment_paddings" in osd_t:
        osd["param_alignment_paddings"] = [
            list(new_paddings[i]) if i in new_paddings else copy.deepcopy(osd_t["param_alignment_paddings"][i])
            for i in range(len(groups))
        ]
    return ordered_like(osd_t, osd)
