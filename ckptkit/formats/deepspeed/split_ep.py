"""The writer's ep split: how each cell's expert groups are partitioned, the identity without experts.

The reader joins experts inside each cell as it reads it (moe.py), or across the tp ranks when
they are whole (join_ep.py); the writer splits them last, in each (stage, tp rank) cell. A cell
without experts is a plain ZeRO cell: the stage's model file (or the source's) with the lane's
slices and sizes. A mixture-of-experts cell (`deepspeed.moe.layer.MoE`, ZeRO 1/2) is `moe_cell`,
as DeepSpeed 0.19 loads it (engine._load_checkpoint, load_moe_state_dict, _load_zero_checkpoint,
stage_1_and_2._load_legacy_checkpoint). Cell rank d is expert-parallel rank d % E and
expert-data-parallel rank d // E (DeepSpeed's default E + D order; with whole experts, which span
the tp x dp ranks, global rank t + tp x d of lane t: the `ExpertSplit`'s lane and stride):
  model_file(mp)               the dense module and num_experts as saved; dp_world_size W (the
                               loader reads that many optim files); param_shapes naming ep rank
                               0's local experts at E
  expert_file(L, G, mp)        expert G under its global name: the same at every E, copied byte
                               for byte (each rank loads its local experts' files and renames
                               them); at a new tp each written from the lane's slices
  optim_file(d, bf16, mp=mp)   read by rank d alone: partition d of W of each dense group, and of
                               each expert group its expert-data-parallel rank's partition,
                               holding its ep rank's experts under their LOCAL ids
                               (param_slice_mappings), partition_count per group, the group
                               named ep_size_<E> (torch's load_state_dict restores the saved group
                               names) and param_alignment_paddings as the engine computes them
Values come from the index (global names) through the ZeRO writer's group plans (group_plan.py):
fp32 masters and every optimizer state sliced lazily, whole values (the step) kept as they were.
Whole experts (`enable_expert_tensor_parallelism=False`): expert G of ep rank e is saved by global
rank e, mp rank e % tp; its file, the same bytes at any size, is copied under that name.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import UnsupportedError
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...torch_types import Size
from ..torch_save.archive_writer import LazyTensor
from .entries import shape_of
from .info import ZeroGroup, ZeroInfo
from .layout import NO_STAGES, WHOLE_EXPERTS, DeepSpeedLayout
from .moe import MARK, split_expert_name
from .names import EXPERT_ID, expert_file
from .native import DeepSpeedNative, native_of
from .split_pp import Stage
from .split_tp import Lane
from .tag_writer import alignment, alignment_paddings, zero_config
from .templates import lazify, template_of
from .writer import Cell, ExpertSplit, stage12_model


def cell(index: CheckpointIndex, lane: Lane, stage: Stage, sizes: ParallelSizes) -> Cell:
    """The ZeRO cell (writer.cell_files) of one (stage, tp rank): what its files add to a plain one's."""
    layout = DeepSpeedLayout.of(index)
    if layout.has_experts:
        whole = layout.experts == WHOLE_EXPERTS
        return moe_cell(
            stage.index,
            stage.info,
            zero_config(index),
            ep=sizes.ep,
            world=sizes.dp,
            mp=stage.mp,
            lane=lane.rank if whole else 0,
            stride=sizes.tp if whole else 1,
            finish_model=None if lane.target is None else lane.finish_model,
        )
    base = stage.model
    if base is None and lane.target is None:
        model12 = None
    elif base is None:
        model12 = lambda info, groups, world: lane.finish_model(stage12_model(info, groups, world))  # noqa: E731
    else:
        model12 = lambda info, groups, world: lane.finish_model(base())  # noqa: E731
    return Cell(
        mp=stage.mp,
        stage12_model=model12,
        stage3_model=None if lane.target is None else lane.finish_stage3_model,
        label=stage.label,
        finish_optim=stage.finish_optim,
    )


def lane_experts(
    index: CheckpointIndex, lane: Lane, sizes: ParallelSizes, tag: str
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A lane's sliced expert files: (written, copied). At the source's tp each is copied byte for
    byte (it does not change with ep or dp); at a new tp each is written from the lane's slices.
    Whole experts are copied once for all lanes (whole_expert_copies)."""
    layout = DeepSpeedLayout.of(index)
    if layout.experts == WHOLE_EXPERTS or not layout.has_experts or layout.stages != NO_STAGES:
        return {}, []
    if sizes.tp == layout.tp:
        info = lane.info
        return {}, [(info.files.prefix + n, f"{tag}/{n}") for n in sorted(info.files.expert_files)]
    counts = dict(index.metadata["deepspeed_moe"]["num_experts"])
    return {f"{tag}/{n}": s for n, s in expert_structures(lane.index, counts, lane.rank).items()}, []


def whole_expert_copies(index: CheckpointIndex, tag: str, sizes: ParallelSizes) -> list[tuple[str, str]]:
    """Whole experts: each expert file copied under the mp rank that saves it at the new sizes."""
    if DeepSpeedLayout.of(index).experts != WHOLE_EXPERTS:
        return []
    return _expert_copies(index, native_of(index), tag, sizes)


# split_params_into_different_moe_groups_for_optimizer's default: a larger expert group is split
MAX_GROUP_SIZE = 178956971


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


def moe_cell(
    index: CheckpointIndex,
    info: ZeroInfo,
    zero_cfg: dict,
    *,
    ep: int,
    world: int,
    mp: int = 0,
    lane: int = 0,
    stride: int = 1,
    finish_model: Callable[[dict], dict] | None = None,
) -> Cell:
    """The ZeRO cell of a MoE checkpoint (writer.cell_files) at `ep` expert-parallel ranks among
    `world` ranks, under model-parallel rank `mp`: dense groups over the `world` ranks, each expert
    group over the ranks of one ep rank (ExpertSplit: cell rank d is global rank lane + stride * d
    of stride * world), its params named with that rank's local expert ids; the model file names ep
    rank 0's local experts (then `finish_model`)."""
    meta = index.metadata["deepspeed_moe"]
    ep_src, counts = int(meta["ep_size"]), dict(meta["num_experts"])
    src_locals = {p: n // ep_src for p, n in counts.items()}
    new_locals = {p: n // ep for p, n in counts.items()}
    m0, marchive = template_of(info, "model", min(info.files.model_files))
    o0, _ = template_of(info, "optim", min(info.files.optim_files))
    osd_t = o0["optimizer_state_dict"]
    groups_meta = osd_t["base_optimizer_state"]["param_groups"]
    m_label = f"{index.root}: {info.files.prefix}{info.files.model_files[min(info.files.model_files)]}"
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
    groups, paddings = _expert_groups(layouts, new_locals, ep, align, m_label)
    split = ExpertSplit(
        ep=ep, groups=groups, paddings=paddings, partitions=stride * world // ep, lane=lane, stride=stride
    )

    def model(info: ZeroInfo, zero_groups: list[ZeroGroup], world: int) -> dict:
        made = _model(m0, marchive, shapes, layouts, new_locals, world)
        return finish_model(made) if finish_model is not None else made

    return Cell(mp=mp, stage12_model=model, experts=split)


def _expert_groups(
    layouts: dict[int, ExpertGroupShape], new_locals: dict[str, int], ep: int, align: int, m_label: str
) -> tuple[dict[int, list[tuple[ZeroGroup, dict[str, str]]]], dict[int, list[int]]]:
    """Each expert group per ep rank at `ep` (its params under their global names, their local
    names on that rank) and its alignment paddings; a group DeepSpeed would split, refused."""
    groups: dict[int, list[tuple[ZeroGroup, dict[str, str]]]] = {}
    paddings: dict[int, list[int]] = {}
    for i in layouts:
        groups[i] = []
        for e in range(ep):
            glob = layouts[i].params(new_locals, e, local_names=False)
            local = layouts[i].params(new_locals, e, local_names=True)
            numel = sum(math.prod(s) for _, s in glob)
            if numel > MAX_GROUP_SIZE:
                raise UnsupportedError(
                    f"{m_label}: expert group {i} would hold {numel} elements per rank at "
                    f"ep={ep}, more than DeepSpeed's max_group_size {MAX_GROUP_SIZE}, which splits it into "
                    f"several groups; resharding to fewer expert-parallel ranks than that is not "
                    f"supported yet"
                )
            paddings[i] = alignment_paddings([s for _, s in glob], align)
            group = ZeroGroup(
                index=i, param_group=i, params=tuple(glob), paddings=tuple(paddings[i]) if any(paddings[i]) else None
            )
            groups[i].append((group, {g: n for (g, _), (n, _) in zip(glob, local)}))
    return groups, paddings


def _is_expert(groups_meta: list, i: int) -> bool:
    return isinstance(groups_meta[i], dict) and bool(groups_meta[i].get("moe"))


def _model(
    m0: dict,
    marchive: Any,
    shapes: list,
    layouts: dict[int, ExpertGroupShape],
    new_locals: dict[str, int],
    world: int,
) -> dict:
    """The one model-states file: the source's, with `world` and ep rank 0's local experts at the new ep."""
    model = lazify(m0, marchive, {})
    model["dp_world_size"] = world
    param_shapes = list(model["param_shapes"])
    for i, layout in layouts.items():
        saved = {split_expert_name(n)[::2]: v for n, v in param_shapes[i].items()}  # keep the saved shape type
        param_shapes[i] = OrderedDict(
            (n, saved.get(split_expert_name(n)[::2], Size(s)))
            for n, s in layout.params(new_locals, 0, local_names=True)
        )
    model["param_shapes"] = param_shapes
    return model


def expert_structures(rank_index: CheckpointIndex, counts: dict[str, int], t: int) -> dict[str, Any]:
    """expert_file(L, G, t): expert G's weight slices under their global names."""
    out: dict[str, Any] = {}
    for layer, (prefix, count) in enumerate(counts.items()):
        for expert in range(count):
            head = f"ds_module.{prefix}{MARK}{expert}."
            out[expert_file(layer, expert, t)] = dict(  # as DeepSpeed saves it
                (key[len("ds_module.") :], LazyTensor(entry))
                for key, entry in rank_index.tensors.items()
                if key.startswith(head)
            )
    return out


def _expert_copies(
    index: CheckpointIndex, info: DeepSpeedNative, tag: str, sizes: ParallelSizes
) -> list[tuple[str, str]]:
    """(source file, output name) of every expert file: expert G of ep rank e under mp rank e % T."""
    counts = dict(index.metadata["deepspeed_moe"]["num_experts"])
    prefix = info.ranks[0].files.prefix
    found: dict[tuple[int, int], str] = {}
    for zinfo in info.ranks.values():
        for name in zinfo.files.expert_files:
            layer, expert = EXPERT_ID.match(name).groups()
            found[(int(layer or 0), int(expert))] = name
    copied = []
    for layer, n in enumerate(counts.values()):
        local = n // sizes.ep
        for expert in range(n):
            mp = (expert // local) % sizes.tp
            copied.append(
                (
                    prefix + found[(layer, expert)],
                    f"{tag}/{expert_file(layer, expert, mp)}",
                )
            )
    return copied
