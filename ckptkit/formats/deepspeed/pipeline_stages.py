"""A PipelineModule's new layer-file stages for a new pipeline and data-parallel size
(`reshard --to pp=P,dp=W`; `--to N` keeps the source's pp), what split_pp.py cuts a lane into.

The pipeline reader (pipeline.py) joins the stages under PipelineModule's global names. Here the
layers are assigned to P new stages as PipelineModule does it (pipeline_partition.py, by the
`--partition-method` the model uses), and each new stage is one ZeRO-1 checkpoint over its own
parameters, laid out by the ZeRO writer's group plans over W ranks (bytes streamed from the
source). Files, as DeepSpeed 0.19's PipelineEngine names and loads them:
  layer_file(XX[, 0])                   copied byte for byte (a layer's own state, local names:
                                        it does not depend on the stage holding the layer)
  model_file(SS)                        stage S's: module None, buffer_names and param_shapes
                                        of its layers, mp_world_size P, dp_world_size W,
                                        checkpoint_parallel_dimensions; the rest as the source's
  optim_file(D, bf16, mp=SS)   partition D of W of stage S's flat groups
A tied module is on every stage that builds one of its layers, its optimizer state with each.

The checkpoint does not record the layers that have no state (functions, a tied layer with a
forward_fn): `layer_table` infers them (a tied module on a stage with none of its layer files has
one such layer there, after the last layer when that stage is the last), and `new_stages` checks
that they split into the source's own stages by the chosen method and that the new stages do not
depend on unseen state-less layers after the last one, else refuses.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from typing import Any, Callable, Sequence

from ...errors import UnsupportedError, UsageError
from ...index.state_keys import model_key
from ...index.types import CheckpointIndex
from ...index.virtual import Part
from ...torch_types import Size
from ..torch_save.archive_writer import LazyTensor
from .group_plan import GroupPlan, virtual
from .info import ZeroGroup, ZeroInfo
from .native import DeepSpeedNative
from .pipeline_partition import is_type_method, partition, type_weights
from .tag_writer import alignment_paddings
from .templates import lazify, template_of


@dataclasses.dataclass(frozen=True, kw_only=True)
class PpTarget:
    pp: int
    dp: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layer:
    """One entry of PipelineModule's layer list as the checkpoint shows it."""

    kind: str  # "layer" (its own parameters), "tied" (a TiedLayerSpec), "none" (no state)
    weight: int  # trainable parameters (what partition_method="parameters" balances)
    key: str | None = None


def _layer_of(name: str) -> int | None:
    head, _, rest = name.partition(".")
    return int(head) if head.isdigit() and rest else None


def _tied_key(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "tied_modules" and len(parts) >= 3 else None


def layer_table(index: CheckpointIndex) -> tuple[list[Layer], dict[int, int]]:
    """PipelineModule's layer list as far as the checkpoint shows it (module docstring), and the
    source stage of each layer it places (layer index -> stage)."""
    info: DeepSpeedNative = index.native
    trainable: dict[str, int] = {}
    tied_on: dict[int, set[str]] = {}
    for s, z in info.stages.items():
        for group in z.groups:
            for name, shape in group.params:
                trainable[name] = math.prod(shape)
        tied_on[s] = {k for n in [*z.buffers, *(p for g in z.groups for p, _ in g.params)] if (k := _tied_key(n))}
    tied_weight: dict[str, int] = {}
    for name, numel in trainable.items():
        if (k := _tied_key(name)) is not None:
            tied_weight[k] = tied_weight.get(k, 0) + numel
    layer_weight: dict[int, int] = {}
    for name, numel in trainable.items():
        if (i := _layer_of(name)) is not None:
            layer_weight[i] = layer_weight.get(i, 0) + numel
    known = dict(info.layers)
    table: dict[int, Layer] = {}
    for i in known:
        key = info.tied_layers.get(i)
        table[i] = (
            Layer(kind="tied", weight=tied_weight.get(key, 0), key=key)
            if key is not None
            else Layer(kind="layer", weight=layer_weight.get(i, 0))
        )
    count = max(known) + 1 if known else 0
    stage_of = dict(known)
    if info.pp == 1 and tied_weight:
        raise UnsupportedError(
            f"{index.root}: a single-stage pipeline checkpoint with tied modules "
            f"({', '.join(sorted(tied_weight))}) does not show which of its state-less layers use "
            f"them (a TiedLayerSpec with a forward_fn writes no file), so its new stages cannot be "
            f"told; resharding it is not supported"
        )
    for s in sorted(info.stages):
        for key in sorted(tied_on.get(s, ())):
            if any(layer.key == key and stage_of.get(i) == s for i, layer in table.items()):
                continue
            later = [i for i, t in known.items() if t > s]
            first_next = min(later) if later else None
            own = [i for i, t in known.items() if t == s]
            lo = min(own) if own else 0
            gaps = [i for i in range(lo, first_next if first_next is not None else count) if i not in table]
            if gaps:
                at = gaps[0]
            elif first_next is None:
                at, count = count, count + 1
            else:
                raise UnsupportedError(
                    f"{index.root}: pipeline stage {s} holds tied module {key} but none of its "
                    f"layers' files, and no layer index is free for it on that stage; resharding "
                    f"it is not supported"
                )
            table[at] = Layer(kind="tied", weight=tied_weight.get(key, 0), key=key)
            stage_of[at] = s
    for i in range(count):
        table.setdefault(i, Layer(kind="none", weight=0))
    return [table[i] for i in range(count)], stage_of


def new_stages(
    index: CheckpointIndex,
    layers: list[Layer],
    stage_of: dict[int, int],
    method: str,
    pp: int,
    layer_types: Sequence[str] | None = None,
) -> tuple[list[Layer], list[int]]:
    """(layers, stage boundaries at `pp`). `layer_types` (--layer-types: PipelineModule's layer
    class names) fix the layer count and give "type:" its weights. Without them, state-less layers
    after the last one the checkpoint shows are unseen: every count of them (up to as many again)
    under which `method` gives the source's own stages is tried, and the stages of the layers with
    state must not depend on it (else refused as undetermined); the fewest such layers are written."""
    info: DeepSpeedNative = index.native
    if layer_types is None and is_type_method(method):
        raise UsageError(
            f"--partition-method {method}: {index.root} does not record its layers' class names, which "
            f"type: matches; give them with --layer-types (the PipelineModule's layers in order, as "
            f"DeepSpeed logs them at start-up, e.g. EmbeddingPipe,ParallelTransformerLayerPipe*24,"
            f"LayerNorm,EmbeddingPipe)"
        )
    if layer_types is not None and len(layer_types) < len(layers):
        raise UsageError(
            f"--layer-types names {len(layer_types)} layers, but {index.root} holds state of layer "
            f"{len(layers) - 1}; give one name per PipelineModule layer"
        )
    extras = range(len(layers) + 1) if layer_types is None else [len(layer_types) - len(layers)]
    given = "" if layer_types is None else f" and --layer-types ({len(layer_types)} layers)"

    def weights_of(cand: list[Layer]) -> list[int]:
        return type_weights(method, layer_types) if is_type_method(method) else [x.weight for x in cand]

    options: dict[tuple[int, ...], tuple[list[Layer], list[int]]] = {}
    for extra in extras:
        cand = layers + [Layer(kind="none", weight=0)] * extra
        weights = weights_of(cand)
        if info.pp > 1:
            src = partition(method, weights, info.pp)
            if any(not src[s] <= i < src[s + 1] for i, s in stage_of.items()):
                continue
        parts = partition(method, weights, pp)
        placed = tuple(
            next(s for s in range(pp) if parts[s] <= i < parts[s + 1]) for i, x in enumerate(layers) if x.kind != "none"
        )
        options.setdefault(placed, (cand, parts))
    if not options:
        cand = layers + [Layer(kind="none", weight=0)] * extras[0]
        src = partition(method, weights_of(cand), info.pp)
        wrong = min(i for i, s in stage_of.items() if not src[s] <= i < src[s + 1])
        raise UnsupportedError(
            f"{index.root}: its {len(cand)} layers (as inferred from the checkpoint{given}) do not "
            f"split into its {info.pp} stages with --partition-method {method} (layer {wrong} is "
            f"on stage {stage_of[wrong]}, the method gives stages at {src}); give the method the "
            f"model uses"
        )
    if len(options) > 1:
        raise UnsupportedError(
            f"{index.root}: which layers go to which of {pp} stages with --partition-method "
            f"{method} depends on how many state-less layers follow layer {len(layers) - 1}, "
            f"which the checkpoint does not record; resharding it to pp={pp} is not supported "
            f"without --layer-types"
        )
    return next(iter(options.values()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """What one new stage holds: its layers, tied keys, groups (names in module order) and buffers."""

    stage: int
    layers: tuple[int, ...]
    tied: tuple[str, ...]
    groups: list[ZeroGroup]
    buffers: list[str]


def stage_plans(index: CheckpointIndex, layers: list[Layer], parts: list[int], align: int) -> list[StagePlan]:
    """Each new stage's parameters in PipelineModule's order: tied modules first (the ModuleDict is
    registered before the layers), in the order the stage builds them, then layer by layer."""
    info: DeepSpeedNative = index.native
    src0 = info.stages[min(info.stages)]
    source_groups: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(len(src0.groups))]
    pads_seen = any(g.paddings is not None for z in info.stages.values() for g in z.groups)
    for _, z in sorted(info.stages.items()):
        if len(z.groups) != len(source_groups):
            raise UnsupportedError(f"{index.root}: its pipeline stages have different numbers of optimizer groups")
        for g, group in enumerate(z.groups):
            source_groups[g] += [p for p in group.params if p[0] not in {n for n, _ in source_groups[g]}]
    buffers: list[str] = []
    for _, z in sorted(info.stages.items()):
        buffers += [b for b in z.buffers if b not in buffers]
    plans = []
    for s in range(len(parts) - 1):
        held = tuple(range(parts[s], parts[s + 1]))
        tied: list[str] = []
        for i in held:
            if layers[i].kind == "tied" and layers[i].key not in tied:
                tied.append(layers[i].key)

        def order(name: str, held=held, tied=tied) -> tuple[int, int] | None:
            key = _tied_key(name)
            if key is not None:
                return (0, tied.index(key)) if key in tied else None
            i = _layer_of(name)
            return (1, i) if i in held else None

        groups = []
        for g, params in enumerate(source_groups):
            mine = sorted((p for p in params if order(p[0]) is not None), key=lambda p: order(p[0]))
            paddings = None
            if align > 1:
                paddings = tuple(alignment_paddings([shape for _, shape in mine], align))
            elif pads_seen:
                paddings = (0,) * len(mine)
            groups.append(ZeroGroup(index=g, param_group=g, params=tuple(mine), paddings=paddings))
        mine_buffers = sorted((b for b in buffers if order(b) is not None), key=order)
        plans.append(StagePlan(stage=s, layers=held, tied=tuple(tied), groups=groups, buffers=mine_buffers))
    return plans


def check_trainable(plan: StagePlan, pp: int) -> None:
    """A new stage must hold trainable parameters: DeepSpeed's ZeRO optimizer cannot hold none."""
    if not any(g.params for g in plan.groups):
        raise UnsupportedError(
            f"--to pp={pp}: new stage {plan.stage} (layers {list(plan.layers)}) would "
            f"have no trainable parameters, which DeepSpeed's ZeRO optimizer cannot hold"
        )


def stage_info(zinfo: ZeroInfo, plan: StagePlan) -> ZeroInfo:
    """A new stage as one ZeRO-1 checkpoint: its groups, the source stage's templates."""
    return dataclasses.replace(zinfo, groups=list(plan.groups), stage=1)


def stage_optim(zinfo: ZeroInfo, plan: StagePlan) -> Callable[[dict, int, list[GroupPlan], dict], dict]:
    """What a new stage's ZeRO-1 cell adds to each optim file (writer.Cell.finish_optim): the
    stage's alignment paddings, BF16_Optimizer's masters with their end padding, and
    BF16_Optimizer's dp rank 0 state in the model file too."""
    o0, _ = template_of(zinfo, "optim", min(zinfo.files.optim_files))
    bf16_optimizer = "zero_stage" not in o0["optimizer_state_dict"]

    def finish_optim(osd: dict, rank: int, plans: list[GroupPlan], model: dict) -> dict:
        if "param_alignment_paddings" in osd:
            osd["param_alignment_paddings"] = [list(g.paddings or (0,) * len(g.params)) for g in plan.groups]
        if bf16_optimizer:  # BF16_Optimizer keeps the end padding in its fp32 partitions
            osd["single_partition_of_fp32_groups"] = [_padded_masters(gp, rank) for gp in plans]
        if rank == 0 and isinstance(model.get("optimizer"), dict):  # BF16_Optimizer: dp rank 0's state here too
            model["optimizer"] = osd
        return osd

    return finish_optim


def _padded_masters(plan: GroupPlan, rank: int) -> LazyTensor:
    """A rank's fp32 partition with its end padding (zeros), as BF16_Optimizer saves it."""
    share = plan.shares[rank]
    parts, position = [], 0
    for slot in share.slots:
        if slot.position > position:
            parts.append(Part(None, 0, slot.position - position))
        parts.append(Part(model_key(slot.name), slot.start, slot.length))
        position = slot.position + slot.length
    if share.size > position:
        parts.append(Part(None, 0, share.size - position))
    return virtual(f"fp32.padded.{plan.group.index}.{rank}", plan.master_dtype, parts, 0, share.size)


def stage_model(m0: dict, marchive: Any, plan: StagePlan, target: PpTarget) -> dict:
    """Stage S's model-states file: the source stage 0's, with this stage's names and the new sizes."""
    model = lazify(m0, marchive, {})
    model["buffer_names"] = list(plan.buffers)
    if isinstance(model.get("param_shapes"), list):  # BF16_Optimizer saves None: left so
        model["param_shapes"] = [OrderedDict((n, Size(s)) for n, s in g.params) for g in plan.groups]
    model["mp_world_size"] = target.pp
    model["dp_world_size"] = target.dp
    if isinstance(model.get("checkpoint_parallel_dimensions"), dict):
        model["checkpoint_parallel_dimensions"] = {**model["checkpoint_parallel_dimensions"], "pp_degree": target.pp}
    return model
