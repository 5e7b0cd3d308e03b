"""A mixture-of-experts PipelineModule's new stages (join_pp.py's mp-rank stages) at new pipeline,
expert-parallel and data-parallel sizes: `reshard --to pp=P,ep=E,dp=W` (`--to N` keeps pp and ep,
dp = N / P), what split_pp.py cuts such a checkpoint into.

DeepSpeed 0.19 saves each stage s as a MoE checkpoint under model-parallel rank s, and its MoE
groups are built inside each stage (groups._create_expert_and_data_parallel with the pipeline's
stride): in stage s, dp rank d is expert-parallel rank d % E. So each new stage is one ZeRO cell
(writer.cell_files) with split_ep.moe_cell's expert split (its dense groups over W ranks, its
expert groups over W/E), under mp rank s, from a template joined from the source stages that held its layers
(their modules, param_shapes and optimizer groups, in layer order).

Which layers a new stage holds: PipelineModule's partition_method, ported in pipeline_partition.py
(`--partition-method`, `--layer-types`). "parameters" counts each layer's trainable parameters as
PipelineModule._count_layer_params does, on the layer built at the TARGET ep (a MoE layer builds
num_experts / ep local experts); the method must give the source's own stages at the source's ep.
Expert files keep their contents (global names) and are renamed: `expert_file(L, G, s)`
counts L per stage (the stage's MoE layers in module order), so L and s are those of the new stage.
A new stage without a MoE layer is refused: DeepSpeed 0.19.8's first train_batch hangs then
(fixtures/generate_ds_pp_moe.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

from ...errors import UnsupportedError, UsageError, quote
from ...index.types import CheckpointIndex
from .info import ZeroGroup, ZeroInfo
from .moe import MARK
from .names import EXPERT_FILE, expert_file
from .native import DeepSpeedNative
from .pipeline_partition import chosen_layer_types, chosen_partition_method, is_type_method, partition, type_weights
from .tag_writer import alignment_paddings
from .templates import lazify, template_of

NO_MOE_STAGE = (
    "DeepSpeed 0.19.8 cannot train a MoE PipelineModule with a stage that holds no MoE layer (its first "
    "train_batch hangs)"
)


def _layer_of(name: str) -> int | None:
    head, _, rest = name.partition(".")
    return int(head) if head.isdigit() and rest else None


def _layer_weights(index: CheckpointIndex, ep: int, count: int) -> list[int]:
    """Trainable parameters of each layer as PipelineModule counts them when it builds the layer
    at expert-parallel size `ep` (its local experts only)."""
    weights = [0] * count
    for key, entry in index.tensors.items():
        if not key.startswith("model."):
            continue
        name = key[len("model.") :]
        i = _layer_of(name)
        if i is None:  # new_parts refused these before
            continue
        numel = math.prod(entry.shape)
        weights[i] += numel // ep if MARK in name else numel  # experts are equal: 1/ep of them per rank
    return weights


def new_parts(index: CheckpointIndex, pp: int, ep: int) -> list[int]:
    """The new stages' boundaries (the source's at its own pp), by the partition method checked to
    give the source's stages at the source's sizes."""
    info: DeepSpeedNative = index.native
    method, types = chosen_partition_method(), chosen_layer_types()
    stage_of: dict[int, int] = {}
    for key, entry in index.tensors.items():
        if key.startswith("model."):
            i = _layer_of(key[len("model.") :])
            if i is None:
                raise UnsupportedError(
                    f"{index.root}: parameter {quote(key[len('model.') :])} belongs to no "
                    f"PipelineModule layer (tied modules are not supported in a "
                    f"mixture-of-experts pipeline yet)"
                )
            stage_of[i] = entry.attrs["parallel"]["pp"]["stage"]
    count = max(stage_of) + 1
    if pp == info.pp:  # the source's own stages, whatever method made them
        held = [sorted(i for i, t in stage_of.items() if t == st) for st in range(pp)]
        for st in range(pp - 1):
            if held[st] and held[st + 1] and held[st][-1] > held[st + 1][0]:
                raise UnsupportedError(
                    f"{index.root}: pipeline stage {st} holds layer {held[st][-1]}, after stage "
                    f"{st + 1}'s layer {held[st + 1][0]}; a PipelineModule places its layers on "
                    f"its stages in order"
                )
        return [0] + [held[st][0] if held[st] else count for st in range(1, pp)] + [count]
    if types is None and is_type_method(method):
        raise UsageError(
            f"--partition-method {method}: {index.root} does not record its layers' class names, which "
            f"type: matches; give them with --layer-types (the PipelineModule's layers in order)"
        )
    if types is not None:
        if len(types) < count:
            raise UsageError(
                f"--layer-types names {len(types)} layers, but {index.root} holds state of layer "
                f"{count - 1}; give one name per PipelineModule layer"
            )
        count = len(types)
    if pp > count:
        raise UsageError(
            f"--to pp={pp}: {index.root} has {count} layers, fewer than the {pp} pipeline stages asked for"
        )

    def weights(at_ep: int) -> list[int]:
        return type_weights(method, types) if is_type_method(method) else _layer_weights(index, at_ep, count)

    src = partition(method, weights(int(index.metadata["deepspeed_moe"]["ep_size"])), info.pp)
    wrong = sorted(i for i, s in stage_of.items() if not src[s] <= i < src[s + 1])
    if wrong:
        raise UnsupportedError(
            f"{index.root}: its {count} layers do not split into its {info.pp} stages with "
            f"--partition-method {method} (layer {wrong[0]} is on stage {stage_of[wrong[0]]}, the "
            f"method gives stages at {src}); give the method the model uses"
        )
    return partition(method, weights(ep), pp)


def stage_template(index: CheckpointIndex, held: range, stage: int, pp: int, align: int) -> tuple[ZeroInfo, dict]:
    """A ZeroInfo whose templates are those of a MoE checkpoint of the layers `held`, joined from
    the source stages (modules, param_shapes, groups in layer order), and its MoE layers' counts."""
    info: DeepSpeedNative = index.native
    z0: ZeroInfo = info.ranks[0]
    m0, marchive = template_of(z0, "model", min(z0.files.model_files))
    o0, _ = template_of(z0, "optim", min(z0.files.optim_files))
    model = lazify(m0, marchive, {})
    module: OrderedDict = OrderedDict()
    shapes: list[OrderedDict] = [OrderedDict() for _ in m0["param_shapes"]]
    buffers: list[str] = []
    groups: dict[int, list] = {}
    for s in range(info.pp):
        z: ZeroInfo = info.ranks[s]
        if [(g.index, g.param_group) for g in z.groups] != [(g.index, g.param_group) for g in z0.groups]:
            raise UnsupportedError(
                f"{index.root}: pipeline stage {s}'s dense optimizer groups "
                f"{[g.index for g in z.groups]} are not stage 0's {[g.index for g in z0.groups]}, "
                f"so its layers cannot join another stage's groups; resharding it to a new pp is "
                f"not supported"
            )
        ms, archive = template_of(z, "model", min(z.files.model_files))
        lazy = lazify(ms, archive, {})
        module.update((n, v) for n, v in lazy["module"].items() if _layer_of(n) in held)
        for g, ps in enumerate(lazy["param_shapes"]):
            shapes[g].update((n, v) for n, v in ps.items() if _layer_of(n) in held)
        buffers += [b for b in z.buffers if _layer_of(b) in held]
        for group in z.groups:
            groups.setdefault(group.index, []).extend(p for p in group.params if _layer_of(p[0]) in held)
    counts = {
        p: n
        for p, n in sorted(index.metadata["deepspeed_moe"]["num_experts"].items(), key=lambda kv: _layer_of(kv[0]) or 0)
        if _layer_of(p) in held
    }
    if not counts:
        raise UnsupportedError(
            f"--to pp={pp}: new pipeline stage {stage} (layers {held.start}..{held.stop - 1}) "
            f"would hold no MoE layer, and {NO_MOE_STAGE}; choose a pp (or --partition-method) "
            f"that gives every stage a MoE layer"
        )
    model.update(
        module=module, param_shapes=shapes, buffer_names=buffers, num_experts=list(counts.values()), mp_world_size=pp
    )
    if isinstance(model.get("checkpoint_parallel_dimensions"), dict):
        model["checkpoint_parallel_dimensions"] = {**model["checkpoint_parallel_dimensions"], "pp_degree": pp}
    dense = [
        ZeroGroup(
            index=g.index,
            param_group=g.param_group,
            params=tuple(groups[g.index]),
            paddings=None
            if g.paddings is None
            else tuple(alignment_paddings([sh for _, sh in groups[g.index]], align)),
        )
        for g in z0.groups
    ]
    optim = dict(o0)
    osd = dict(o0["optimizer_state_dict"])
    if isinstance(osd.get("param_alignment_paddings"), list):
        osd["param_alignment_paddings"] = [alignment_paddings([tuple(v) for v in ps.values()], align) for ps in shapes]
    optim["optimizer_state_dict"] = osd
    zinfo = dataclasses.replace(
        z0,
        groups=dense,
        buffers=buffers,
        model_states={min(z0.files.model_files): model},
        optim_states={min(z0.files.optim_files): optim},
    )
    return zinfo, counts


def stage_copies(
    layer_ids: dict[tuple[int, str], tuple[str, int, str]], stage: int, counts: dict[str, int], tag: str
) -> list[tuple[str, str]]:
    """New stage `stage`'s expert files: each source expert file (`layer_ids`: source_layer_ids) of
    one of its MoE layers (`counts`, in module order), copied under the stage's own layer id and mp rank."""
    new_id = {prefix: n for n, prefix in enumerate(counts)}
    return [
        (rel, f"{tag}/{expert_file(new_id[prefix], expert, stage)}")
        for _, (rel, expert, prefix) in sorted(layer_ids.items())
        if prefix in new_id
    ]


def source_layer_ids(index: CheckpointIndex) -> dict[tuple[int, str], tuple[str, int, str]]:
    """Each source expert file (stage, name) -> (its path, expert id, MoE prefix): its L-th MoE
    layer is the stage's L-th in module order."""
    info: DeepSpeedNative = index.native
    out: dict[tuple[int, str], tuple[str, int, str]] = {}
    for stage, zinfo in info.ranks.items():
        prefixes = sorted(info.num_experts[stage], key=lambda p: _layer_of(p) or 0)
        for name in zinfo.files.expert_files:
            m = EXPERT_FILE.match(name)
            if m is None or m.group(1) is None or int(m.group(1)) >= len(prefixes):
                raise UnsupportedError(
                    f"{index.root}: expert file {quote(name)} of pipeline stage {stage} names a "
                    f"MoE layer the stage does not have ({len(prefixes)} MoE layers)"
                )
            out[(stage, name)] = (zinfo.files.prefix + name, int(m.group(2)), prefixes[int(m.group(1))])
    return out
