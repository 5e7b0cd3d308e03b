"""Index a DeepSpeed pipeline-parallel checkpoint (a `deepspeed.pipe.PipelineModule` engine).

What DeepSpeed writes in the tag folder (ZeRO stage 0/1 only: PipelineEngine refuses 2 and 3):
  layer_file(XX)                                one per layer holding a state_dict (XX the global
                                                layer index; local names, e.g. `fc_in.weight`),
                                                written by data-parallel rank 0 of its stage; a
                                                tied layer with a forward_fn (a functools.partial)
                                                has none. A topology with a `model` axis (tensor
                                                parallelism, Megatron-DeepSpeed's) adds `tp_suffix(YY)`,
                                                YY the tp rank (join_tp.py joins tp > 1).
  model_file(SS)                                one per stage S (`module` is None; buffer_names,
                                                param_shapes with the stage's global names)
  optim_file(D, bf16, mp=SS)                    one per (data-parallel rank D, stage S): each
                                                stage is one ordinary ZeRO checkpoint over its own
                                                parameters
The numbers: the mp rank is the grid's model-parallel rank (stage * tp + tp rank), the zero_pp rank
the rank within the stage's data-parallel group.

Each stage is read with the ZeRO reader's own parts (the optim files' flat groups), and the
stages are joined into one index whose names are those `PipelineModule.state_dict()` gives on
the full model: `<layer_idx>.<param>` for a layer and `tied_modules.<key>.<param>` for a tied
one. A tied module is held by every stage using it (DeepSpeed all-reduces its gradient, so the
copies agree); it appears once, from the lowest stage. The layer files give `ds_module.<name>`
(the low-precision weights), buffers and frozen parameters (`model.<name>`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...errors import CkptkitError, FormatError, UnsupportedError
from ...index.state_keys import model_key, model_path
from ...index.types import Box, CheckpointIndex, Piece, TensorEntry
from ...runner.torch_archive import Archive, load_structure, open_archive
from ...safeload import TensorRef
from ...storage.source import Source
from . import join_pp
from . import reader as zero
from .entries import entry, tensor_of
from .files import ZeroFiles, read_latest
from .names import (
    LATEST,
    LAYER_FILE,
    MODEL_STATES,
    OPTIM_STATES,
    layer_file,
    looks_like_tag_folder,
    model_file,
    mp_rank,
)
from .names import tp_suffix
from .flat_groups import RankFiles, read_flat_groups
from .info import ZeroInfo, stage_names
from .layout import LAYER_FILES, DeepSpeedLayout
from .native import Copies, PipelineLane


def layer_files(files: ZeroFiles, model_rank: int = 0) -> dict[int, str]:
    """layer index -> file name, of the tag folder's names the ZeRO file scan left over: tp rank
    `model_rank`'s (`tp_suffix(YY)`, which a topology with a `model` axis always writes,
    Megatron-DeepSpeed's among them; no suffix without one)."""
    return {
        int(m.group(1)): name
        for name in files.extra
        if (m := LAYER_FILE.match(name)) and int(m.group(2) or 0) == model_rank
    }


def tp_size(files: ZeroFiles) -> int:
    """The tensor-parallel size the layer files show: the highest `tp_suffix(YY)` + 1."""
    return 1 + max((int(m.group(2) or 0) for n in files.extra if (m := LAYER_FILE.match(n))), default=0)


def _tag_listing(source: Source, tag: str | None) -> tuple[str, list[str]] | None:
    """(prefix, names) of the tag folder (`--tag`, else the folder given when it holds rank
    files, else `latest`'s); None when there is none. It only lists folders and never reports a
    problem itself: anything odd is left to the ZeRO reader, which names it."""
    try:
        names = source.listdir("")
        if tag is None and looks_like_tag_folder(names) or tag is None and any(LAYER_FILE.match(n) for n in names):
            return "", names
        if tag is None:
            if LATEST not in names or source.isdir(LATEST):
                return None
            tag = read_latest(source)
        if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or not source.isdir(tag):
            return None
        return tag + "/", source.listdir(tag)
    except CkptkitError:
        return None


def detect(source: Source, tag: str | None = None) -> bool:
    """The tag folder holds per-layer files: a PipelineModule's checkpoint."""
    listing = _tag_listing(source, tag)
    return listing is not None and any(LAYER_FILE.match(name) for name in listing[1])


def check_tag(source: Source, tag: str | None = None) -> None:
    """A PipelineModule's tag folder holds ZeRO optim-states files (stage 0 in fp32 or fp16 has none)."""
    listing = _tag_listing(source, tag)
    if (
        listing is not None
        and not any(OPTIM_STATES.match(n) for n in listing[1])
        and any(MODEL_STATES.match(n) for n in listing[1])
    ):
        raise UnsupportedError(
            f"{source.label(listing[0])}: a pipeline checkpoint without ZeRO optim-states files "
            f"(ZeRO stage 0 in fp32 or fp16 keeps the optimizer's state in the "
            f"{model_file('XX')} files) is not supported yet"
        )


def lane_grid(source: Source, files: ZeroFiles, label: str) -> DeepSpeedLayout:
    """The stages x tp ranks a PipelineModule's files show: tp from the layer files' `tp_suffix(YY)`,
    the stages the mp ranks per tp rank (every layer's file there for each tp rank)."""
    tp = tp_size(files)
    ranks = sorted(files.model_parallel) if files.model_parallel else [0]
    if tp == 1:
        return DeepSpeedLayout(tp=1, pp=len(ranks), stages=LAYER_FILES)
    if len(ranks) % tp:
        raise FormatError(
            f"{label}: layer files name {tp} tensor-parallel ranks ({tp_suffix(0)}..{tp_suffix(tp - 1)}), "
            f"but there are {len(ranks)} model-parallel ranks ({mp_rank('XX')}), not a multiple of {tp}"
        )
    _check_tp_layer_files(source, files, tp)
    return DeepSpeedLayout(tp=tp, pp=len(ranks) // tp, stages=LAYER_FILES)


def read_lane(
    source: Source, files: ZeroFiles, grid: DeepSpeedLayout, model_rank: int
) -> tuple[CheckpointIndex, dict[int, ZeroInfo], PipelineLane]:
    """The pipeline of tp rank `model_rank`: each stage s (mp rank s * tp + model_rank) read as a
    ZeRO checkpoint with its layer files (those ending `tp_suffix(model_rank)`), then joined over pp
    (join_pp.merge_stage). Returns its index, each stage's ZeroInfo and its layer files' facts."""
    if grid.tp == 1:  # mp rank = stage; a missing stage is named by _check_stage_count
        per_stage = dict(sorted((files.model_parallel or {0: files}).items()))
    else:
        per_stage = {s: files.model_parallel[grid.mp_rank(s, model_rank)] for s in range(grid.pp)}
    opened = _open_layers(source, files, model_rank)
    stages = {s: _read_stage(source, sub, opened, s) for s, sub in sorted(per_stage.items())}
    _check_stage_count(source, files, stages)
    layers = _assign_layers(source, files, stages, model_rank)
    pp, dp = len(stages), stages[0].info.world_size
    index = CheckpointIndex(format=zero.FORMAT, root=source.root, world_size=pp * dp)
    owner: dict[str, int] = {}
    replicas: Copies = {}
    tied_layers: dict[int, str] = {}
    for s, stage in stages.items():
        tied_layers.update(
            _add_layer_files(source, stage, [(layer, opened[layer]) for layer, at in layers.items() if at == s])
        )
        join_pp.merge_stage(index, stage.index, s, pp, owner, replicas)
    first = stages[0].index
    index.step = first.step
    index.metadata.update({k: v for k, v in first.metadata.items() if k != "deepspeed"})
    index.metadata["deepspeed"] = {
        **first.metadata.get("deepspeed", {}),
        "world_size": pp * dp,
        "pipeline": {
            "stages": pp,
            "layers": {str(k): v for k, v in sorted(layers.items())},
            "tied": sorted({n for n in owner if n.startswith("tied_modules.")}),
        },
    }
    index.metadata["parallel"] = {"pp": pp, "dp": dp}
    lane = PipelineLane(
        layers=layers,
        layer_files={k: f.rel for k, f in opened.items()},
        tied_layers=tied_layers,
        tied_copies=replicas,
    )
    return index, {s: st.info for s, st in stages.items()}, lane


def _check_tp_layer_files(source: Source, files: ZeroFiles, tp: int) -> None:
    """Every layer with a file for some tp rank has one for each (DeepSpeed's data-parallel rank 0
    of every (stage, tp rank) writes its layers)."""
    per_rank = {t: layer_files(files, t) for t in range(tp)}
    every = sorted(set().union(*per_rank.values()))
    for t, have in per_rank.items():
        for layer in every:
            if layer not in have:
                other = next(r for r in range(tp) if layer in per_rank[r])
                raise FormatError(
                    f"{source.label(files.prefix + layer_file(layer, t))}: "
                    f"file is missing (tensor-parallel rank {other} has layer {layer}'s file; a pipeline "
                    f"with {tp} tensor-parallel ranks writes one per rank)"
                )


def _check_stage_count(source: Source, files: ZeroFiles, stages: dict[int, "_Stage"]) -> None:
    """Every stage's files are there: the model-states file records the pipeline's size (a stage
    whose files are all gone would otherwise leave its layer files looking like frozen layers)."""
    m0 = stages[0].info.model_states[min(stages[0].info.model_states)]
    dims = m0.get("checkpoint_parallel_dimensions") if isinstance(m0, dict) else None
    pp = dims.get("pp_degree") if isinstance(dims, dict) else m0.get("mp_world_size")
    tp = tp_size(files)
    if isinstance(pp, int) and tp > 1 and not isinstance(dims, dict):
        pp //= tp  # mp_world_size counts stage x tp ranks
    if isinstance(pp, int) and pp > len(stages):
        missing = [s for s in range(pp) if s not in stages]
        raise FormatError(
            f"{stages[0].label}: says the pipeline has {pp} stages, but the model- and optim-states "
            f"files of stage(s) {missing} ({mp_rank(missing[0])}_...) are missing"
        )


@dataclass(kw_only=True)
class _Stage:
    """One stage read as a ZeRO checkpoint over its own parameters."""

    stage: int
    index: CheckpointIndex
    info: ZeroInfo
    owned: set[str]  # the optimizer's parameters (global names)
    shapes: dict[str, tuple[int, ...]]
    buffers: list[str]
    label: str  # its model-states file


@dataclass(frozen=True, kw_only=True)
class _LayerFile:
    """One opened `layer_file(XX)`: the layer's state dict (local names), lazily loaded."""

    rel: str
    archive: Archive
    state: dict


def _open_layers(source: Source, files: ZeroFiles, model_rank: int = 0) -> dict[int, _LayerFile]:
    opened = {}
    for layer, name in sorted(layer_files(files, model_rank).items()):
        rel = files.prefix + name
        archive = open_archive(source, rel)
        state = load_structure(archive, eager=False)
        if not isinstance(state, dict):
            raise FormatError(f"{archive.label}: is a {type(state).__name__}, expected a layer's state dict")
        opened[layer] = _LayerFile(rel=rel, archive=archive, state=state)
    return opened


def _read_stage(source: Source, files: ZeroFiles, layers: dict[int, _LayerFile], stage_id: int) -> _Stage:
    """The ZeRO reader's steps for one stage, without `module` (None: the layer files hold it)."""
    archives: dict[str, Archive] = {}
    optim = zero.load_ranks(source, files, files.optim_files, archives)
    model = zero.load_ranks(source, files, files.model_files, archives)
    if not optim or not model:
        raise FormatError(
            f"{source.label(files.prefix)}: no {'optim' if not optim else 'model'}-states file of "
            f"pipeline stage {stage_id} could be read"
        )
    first_optim = source.label(files.prefix + files.optim_files[min(optim)])
    osd0 = entry(optim[min(optim)], "optimizer_state_dict", first_optim)
    bf16_optimizer = _is_bf16_optimizer(osd0)
    stage = 1 if bf16_optimizer else zero.read_zero_stage(osd0, first_optim)
    world = max(files.optim_files) + 1
    m0_name = files.prefix + files.model_files[min(model)]
    m0 = model[min(model)]
    label = source.label(m0_name)
    zero.check_world(source, files, stage, world, m0, label)
    if stage != 1:
        raise UnsupportedError(
            f"{first_optim}: a pipeline checkpoint at ZeRO stage {stage} (DeepSpeed's "
            f"PipelineEngine runs stage 0 or 1 only)"
        )
    index = zero.new_index(source, archives, world)
    buffers = list(entry(m0, "buffer_names", label))
    param_shapes = entry(m0, "param_shapes", label)
    if param_shapes is None and bf16_optimizer:  # not saved without ZeRO: the optim files' slice maps say it
        param_shapes = _bf16_param_shapes(files, optim, layers, first_optim)
    if not isinstance(param_shapes, list):
        raise FormatError(f"{label}: param_shapes must be a list of per-group shape maps")
    groups_meta, groups = zero.stage12_groups(osd0, param_shapes, first_optim)
    read_flat_groups(
        index,
        stage,
        RankFiles(files=files, archives=archives, optim=optim, world_size=world),
        groups,
        stage_names(stage),
    )
    zero.add_param_groups(index, groups_meta, groups)
    zero.add_objects(index, 0 if bf16_optimizer else stage, archives[m0_name], m0, optim[min(optim)])
    steps = index.objects.get("ds.global_steps")
    index.step = steps.data if steps is not None and isinstance(steps.data, int) else None
    index.metadata["deepspeed"] = {
        "stage": 0 if bf16_optimizer else stage,
        "world_size": world,
        "tag": files.tag,
        "bf16_file_prefix": files.bf16_prefix,
        "dtype": "float32",
        "optimizer": "BF16_Optimizer" if bf16_optimizer else "ZeRO",
    }
    index.metadata["consolidate_dtype"] = "float32"
    shapes = {name: shape for group in groups for name, shape in group.params}
    info = ZeroInfo(
        stage=stage,
        world_size=world,
        files=files,
        groups=groups,
        frozen={},
        buffers=buffers,
        shared=dict(m0.get("shared_params") or {}),
        model_states=model,
        optim_states=optim,
        archives=archives,
        param_group_count=len(groups_meta),
    )
    return _Stage(
        stage=stage_id, index=index, info=info, owned=set(shapes), shapes=shapes, buffers=buffers, label=label
    )


def _is_bf16_optimizer(osd: Any) -> bool:
    """DeepSpeed's BF16_Optimizer (ZeRO stage 0 with bf16 in a pipeline): no zero_stage, but the
    ZeRO-1 layout itself (flat fp32 partitions per group, padded to 2 * dp, equal shares)."""
    return (
        isinstance(osd, dict)
        and "zero_stage" not in osd
        and isinstance(osd.get("base_optimizer_state"), dict)
        and isinstance(osd.get("single_partition_of_fp32_groups"), list)
        and "partition_count" in osd
    )


def _bf16_param_shapes(
    files: ZeroFiles, optim: dict[int, Any], layers: dict[int, _LayerFile], label: str
) -> list[dict[str, tuple[int, ...]]]:
    """BF16_Optimizer's groups as param_shapes would list them: each group's names in flat order
    from the ranks' `param_slice_mappings` (name -> (numel, start) of the rank's share), each
    shape from the layer file holding it (`<layer>.<param>`), a tied module's from the layer file
    whose local name and element count match; the ranks' element counts must add up to it."""
    maps = {
        rank: entry(entry(state, "optimizer_state_dict", label), "param_slice_mappings", label)
        for rank, state in sorted(optim.items())
    }
    groups = max(len(m) if isinstance(m, list) else 0 for m in maps.values())
    out: list[dict[str, tuple[int, ...]]] = []
    for g in range(groups):
        numels: dict[str, int] = {}
        for rank, mapping in maps.items():
            if not isinstance(mapping, list) or g >= len(mapping) or not isinstance(mapping[g], dict):
                raise FormatError(f"{label}: rank {rank}'s param_slice_mappings has no group {g}")
            for name, address in mapping[g].items():
                numel = getattr(address, "numel", None)
                if not isinstance(numel, int) or numel < 0:
                    raise FormatError(f"{label}: param_slice_mappings[{g}][{name}] is not a fragment address")
                numels[str(name)] = numels.get(str(name), 0) + numel
        out.append({name: _shape_from_layers(name, numel, layers, label) for name, numel in numels.items()})
    return out


def _shape_from_layers(name: str, numel: int, layers: dict[int, _LayerFile], label: str) -> tuple[int, ...]:
    parts = _layer_names(name)
    if parts is not None:
        candidates = [layers[parts[0]].state.get(parts[1])] if parts[0] in layers else []
    else:
        local = name.split(".", 2)[-1] if name.startswith("tied_modules.") else name
        candidates = [f.state.get(local) for f in layers.values()]
    held = {tuple(ref.size) for ref in candidates if isinstance(ref, TensorRef)}
    shapes = {shape for shape in held if math.prod(shape) == numel}
    if len(shapes) != 1:
        found = (
            f"layer files give shapes {sorted(shapes)}"
            if shapes
            else f"its layer file's shape is {sorted(held)[0]}"
            if len(held) == 1
            else "no layer file holds a tensor of that size"
        )
        raise FormatError(
            f"{label}: parameter {name} has {numel} elements in the ranks' param_slice_mappings, but {found}"
        )
    return shapes.pop()


def _layer_names(name: str) -> tuple[int, str] | None:
    """(layer index, local name) of a global `<layer_idx>.<param>` name."""
    head, _, rest = name.partition(".")
    return (int(head), rest) if head.isdigit() and rest else None


def _assign_layers(source: Source, files: ZeroFiles, stages: dict[int, _Stage], model_rank: int = 0) -> dict[int, int]:
    """layer index -> the stage holding it: from each stage's parameter and buffer names; a
    layer with none of them (all frozen, or tied) goes with the layer before it. Every layer a
    stage names has its file."""
    known: dict[int, int] = {}
    for s, stage in stages.items():
        for name in [*stage.shapes, *stage.buffers]:
            if (parts := _layer_names(name)) is not None:
                known.setdefault(parts[0], s)
    on_disk = layer_files(files, model_rank)
    for layer, s in sorted(known.items()):
        if layer not in on_disk:
            names = [n for n in [*stages[s].shapes, *stages[s].buffers] if (_layer_names(n) or (None,))[0] == layer]
            tp_rank = model_rank if any(LAYER_FILE.match(n).group(2) for n in on_disk.values()) else None
            raise FormatError(
                f"{source.label(files.prefix + layer_file(layer, tp_rank))}: file is missing "
                f"(pipeline stage {s} holds layer {layer}'s {', '.join(names[:3])})"
            )
    layers = dict(known)
    for layer in sorted(on_disk):
        if layer not in layers:
            lower = [s for other, s in layers.items() if other < layer]
            layers[layer] = max(lower) if lower else 0
    return dict(sorted(layers.items()))


def _add_layer_files(source: Source, stage: _Stage, layers: list[tuple[int, _LayerFile]]) -> dict[int, str]:
    """Each layer file's tensors under global names: buffers and frozen params as `model.<name>`,
    every weight as `ds_module.<name>`; a shape that disagrees with param_shapes is refused.
    Returns layer index -> tied key of the files that hold a tied module."""
    tied: dict[int, str] = {}
    for layer, opened in layers:
        rel, archive, state = opened.rel, opened.archive, opened.state
        stage.index.files[rel] = source.size(rel)
        stage.index.checks.extend(archive.checks())
        prefix = _global_prefix(archive.label, layer, list(state), stage)
        if prefix.startswith("tied_modules."):
            tied[layer] = prefix.split(".")[1]
        for local, ref in state.items():
            if not isinstance(ref, TensorRef):
                continue
            name = prefix + str(local)
            dtype, loc, shape = tensor_of(archive, ref, f"{local!r}")
            want = stage.shapes.get(name)
            if want is not None and tuple(want) != tuple(shape):
                raise FormatError(
                    f"{archive.label}: {local} has shape {list(shape)}, but pipeline stage "
                    f"{stage.stage}'s param_shapes says {name} is {list(want)}"
                )
            pieces = [Piece(Box.whole(shape), loc)]
            if f"ds_module.{name}" in stage.index.tensors:
                continue  # a tied module saved by two of the stage's layers: the first is kept
            if name in stage.buffers:
                stage.index.add_tensor(
                    TensorEntry(
                        model_key(name), dtype, shape, pieces, path=model_path(name), attrs={"ds_role": "buffer"}
                    )
                )
                continue
            stage.index.add_tensor(TensorEntry(f"ds_module.{name}", dtype, shape, pieces, path=("ds_module", name)))
            if name not in stage.owned:
                stage.index.add_tensor(
                    TensorEntry(
                        model_key(name), dtype, shape, list(pieces), path=model_path(name), attrs={"ds_role": "frozen"}
                    )
                )
                stage.info.frozen[name] = shape
            elif dtype in ("float16", "bfloat16"):
                stage.index.metadata["deepspeed"]["dtype"] = dtype
    return tied


def _global_prefix(label: str, layer: int, local: list[str], stage: _Stage) -> str:
    """`<layer>.` for an ordinary layer; `tied_modules.<key>.` when the file holds a tied module
    (its names are none of the stage's `<layer>.` names but a tied module's)."""
    known = set(stage.shapes) | set(stage.buffers)
    if any(f"{layer}.{n}" in known for n in local):
        return f"{layer}."
    keys = {n.split(".")[1] for n in known if n.startswith("tied_modules.") and n.count(".") >= 2}
    matches = [k for k in sorted(keys) if any(f"tied_modules.{k}.{n}" in known for n in local)]
    if len(matches) > 1:
        raise UnsupportedError(
            f"{label}: layer {layer}'s names match tied modules {matches}; which one it holds cannot be told"
        )
    return f"tied_modules.{matches[0]}." if matches else f"{layer}."
