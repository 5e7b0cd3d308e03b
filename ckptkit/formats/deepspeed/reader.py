"""Index one DeepSpeed ZeRO checkpoint (stages 1-3, fp32/fp16/bf16) without importing deepspeed:
a (stage, tp rank) cell, which read.py joins with the others over ep, pp and tp.

Keys follow torch's recipe so every other operation treats it like any checkpoint:
  model.<name>                    fp32 master weights (flat-range pieces of the rank partitions),
                                  frozen params (stored precision) and buffers
  optim.state.<name>.<key>        every key of the optimizer's state, whatever the optimizer: a key
                                  with the flat partition's length (exp_avg, momentum_buffer, sum,
                                  square_avg...) as flat-range pieces like the masters; any other
                                  (torch's 0-d step, an int step) as the group's one value, kept
                                  whole for each of its parameters (ckptkit.optim_state)
  optim.param_groups.<g>.<hyper>  hyperparameters; .params lists the group's names
  ds_module.<name>                the low-precision module weights of the model-states file
  ds.<key>                        DeepSpeed's own values (global_steps, lr_scheduler, loss_scaler, ...)
  client.<key>                    client_state passed to save_checkpoint
Tied parameters (shared_params) appear as aliases of their owner.

The parts are read in order (files, module and buffers, frozen params, the groups' flat buffers
in flat_groups.py), then `ZeroInfo` is built once from them.
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import CkptkitError, FormatError, UnsupportedError, quote
from ...index import problems
from ...index.state_keys import model_key, model_path, param_group_key, param_group_path
from ...index.types import Box, CheckpointIndex, FlatRange, Location, ObjectEntry, Piece, TensorEntry
from ...safeload import TensorRef
from ...storage.source import Source
from ...runner.torch_archive import Archive, LastStructure, empty_view, load_structure, open_archive
from ..torch_save.reader import materialize
from . import join_ep, moe, partition, standins
from .entries import entry, plain_shape, shape_of, tensor_of
from .files import ZeroFiles
from .names import optim_file, zero_model_file
from .flat_groups import RankFiles, read_flat_groups
from .info import ZeroGroup, ZeroInfo, stage_names

FORMAT = "deepspeed"
STRUCTURAL_KEYS = {
    "module",
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "optimizer",
}
DS_KEYS = {
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
    "iteration",
    "compression",
    "num_experts",
    "ds_autoep_layers",
}  # the last two: MoE checkpoints (moe.py)


def read_zero(source: Source, files: ZeroFiles, *, optimizer: bool = True) -> tuple[CheckpointIndex, ZeroInfo]:
    """One ZeRO checkpoint, a (stage, tp rank) cell: the files of one model-parallel rank, with its
    experts joined over ep when they are sliced (moe.py). `optimizer` False (the weights alone are
    wanted): a plain checkpoint's optimizer state is read and checked but its per-parameter entries
    only counted (flat_groups.UNINDEXED_OPTIMIZER); expert checkpoints are indexed whole regardless."""
    archives: dict[str, Archive] = {}
    optim = load_ranks(source, files, files.optim_files, archives)
    model = load_ranks(source, files, files.model_files, archives)
    if not optim or not model:
        raise FormatError(
            f"{source.label(files.prefix)}: no {'optim' if not optim else 'model'}-states file of the tag could be read"
        )
    first_optim = source.label(files.prefix + files.optim_files[min(optim)])
    osd0 = entry(optim[min(optim)], "optimizer_state_dict", first_optim)
    stage = read_zero_stage(osd0, first_optim)
    world = max(files.optim_files) + 1  # ranks short of it were missing (verify listed them)
    m0_name = files.prefix + files.model_files[min(model)]
    m0 = model[min(model)]
    label = source.label(m0_name)
    check_world(source, files, stage, world, m0, label)
    index = new_index(source, archives, world)
    buffers = list(entry(m0, "buffer_names", label))
    shared = dict(m0.get("shared_params") or {})
    param_shapes = entry(m0, "param_shapes", label)
    if not isinstance(param_shapes, list):
        raise FormatError(f"{label}: param_shapes must be a list of per-group shape maps")
    dtype = _module_and_buffers(index, stage, buffers, archives[m0_name], m0, label)
    frozen = _frozen(index, stage, world, files, archives, model, label)
    groups_meta, groups = (stage12_groups if stage < 3 else _stage3_groups)(osd0, param_shapes, first_optim)
    ranks = RankFiles(files=files, archives=archives, optim=optim, world_size=world)
    _check_partitions(ranks, stage, len(groups), plain=not files.whole_experts and not files.expert_files)
    flat_groups = groups
    if files.whole_experts:  # the expert groups span the mp ranks: join_ep.py reads them after the tp join
        flat_groups = join_ep.dense_groups(groups_meta, groups)
    elif files.expert_files:  # mixture of experts: moe.py reads the expert files and expert groups
        flat_groups, groups = moe.read_experts(source, index, stage, ranks, groups_meta, groups, m0, label)
    plain = not files.whole_experts and not files.expert_files
    read_flat_groups(index, stage, ranks, flat_groups, stage_names(stage), optimizer=optimizer or not plain)
    if stage == 1:  # frozen params live only in `module`
        frozen = {**frozen, **_stage1_frozen(index, groups, buffers, shared)}
    add_param_groups(index, groups_meta, groups)
    _aliases(index, shared, label)
    add_objects(index, stage, archives[m0_name], m0, optim[min(optim)])
    steps = index.objects.get("ds.global_steps")
    index.step = steps.data if steps is not None and isinstance(steps.data, int) else None
    index.metadata["deepspeed"] = {
        "stage": stage,
        "world_size": world,
        "tag": files.tag,
        "bf16_file_prefix": files.bf16_prefix,
        "dtype": dtype,
    }
    index.metadata["consolidate_dtype"] = "float32"  # zero_to_fp32 upcasts frozen params and buffers
    return index, ZeroInfo(
        stage=stage,
        world_size=world,
        files=files,
        groups=groups,
        frozen=frozen,
        buffers=buffers,
        shared=shared,
        model_states=model,
        optim_states=optim,
        archives=archives,
        param_group_count=len(groups_meta),
        dtype=dtype,
    )


def new_index(source: Source, archives: dict[str, Archive], world: int) -> CheckpointIndex:
    """An index listing the files read and their integrity checks."""
    index = CheckpointIndex(format=FORMAT, root=source.root, world_size=world)
    for rel, arch in archives.items():
        index.files[rel] = source.size(rel)
        index.checks.extend(arch.checks())
    return index


def load_ranks(source: Source, files: ZeroFiles, names: dict[int, str], archives: dict[str, Archive]) -> dict:
    """rank -> lazily loaded structure of each file named; the archives opened kept in `archives`.
    Under verify, an unreadable file is listed and left out, and the other ranks still read."""
    loaded = {}
    alike = LastStructure()  # ranks' files that pickle alike are unpickled once (ZeRO-3 model states)
    for rank, name in sorted(names.items()):
        rel = files.prefix + name
        try:
            archive = open_archive(source, rel)
            structure = load_structure(archive, eager=False, memo=alike)
        except CkptkitError as exc:
            if not problems.collecting_now():
                raise
            problem = exc
            if _truncated_zip(source, rel):
                problem = FormatError(
                    f"{source.label(rel)}: is truncated: a zip archive without its end record "
                    f"({source.size(rel)} bytes; the file was cut short)"
                )
            problems.tolerate(problem, source.label(rel))
            continue
        archives[rel] = archive
        if structure is not None:
            loaded[rank] = structure
    return loaded


def read_zero_stage(osd0: Any, label: str) -> int:
    """The ZeRO stage of the optimizer state, refusing the layouts not read yet."""
    if "zero_stage" not in osd0:
        raise UnsupportedError(
            f"{label}: optimizer state without a zero_stage: the "
            f"BF16_Optimizer / ZeRO stage 0 layout is not supported yet"
        )
    stage = int(standins.enum_value(osd0["zero_stage"]))
    if stage not in (1, 2, 3):
        raise UnsupportedError(f"{label}: ZeRO stage {stage} is not supported")
    if osd0.get("elastic_checkpoint") or (
        stage < 3 and "base_optimizer_state" in osd0 and isinstance(osd0["base_optimizer_state"], list)
    ):
        raise UnsupportedError(f"{label}: elastic ZeRO checkpoints are not supported yet")
    return stage


def check_world(source: Source, files: ZeroFiles, stage: int, world: int, m0: Any, label: str) -> None:
    """One model-states file per rank at stage 3; dp_world_size, when saved, agrees with the files."""
    if stage == 3 and len(files.model_files) != world and not _tolerate_missing_models(source, files, world):
        raise FormatError(
            f"{source.label(files.prefix)}: ZeRO-3 needs one model-states file per rank, found "
            f"{len(files.model_files)} for {world} optim-states files"
        )
    dp = m0.get("dp_world_size") if isinstance(m0, dict) else None
    if isinstance(dp, int) and dp > world:  # the last ranks' files are gone: name them
        names = ", ".join(optim_file(r, files.bf16_prefix, files.mp_rank) for r in range(world, min(dp, world + 3)))
        more = f" and {dp - world - 3} more" if dp - world > 3 else ""
        which = f"file of rank {world} is" if dp - world == 1 else f"files of ranks {world}..{dp - 1} are"
        raise FormatError(f"{label}: says dp_world_size {dp}, but the optim-states {which} missing ({names}{more})")
    if isinstance(dp, int) and dp != world:
        raise FormatError(f"{label}: says dp_world_size {dp} but there are {world} optim-states files")


def _check_partitions(ranks: RankFiles, stage: int, groups: int, *, plain: bool) -> None:
    """Every rank holds one flat partition per (sub-)group the checkpoint describes (DeepSpeed's
    zero_to_fp32 refuses the same), so none is left unread; and, without experts (whose groups span
    fewer ranks), partition_count, when saved, is the number of optim-states files."""
    names = stage_names(stage)
    for rank in sorted(ranks.optim):
        arch = ranks.archive(rank)
        osd = entry(ranks.optim[rank], "optimizer_state_dict", arch.label)
        if isinstance(osd, dict) and read_zero_stage(osd, arch.label) != stage:  # (one checkpoint, one layout)
            raise FormatError(
                f"{arch.label}: says ZeRO stage {read_zero_stage(osd, arch.label)}, the first rank's file "
                f"stage {stage}; refusing to pick one"
            )
        masters = entry(osd, names.masters, arch.label)
        if isinstance(masters, list) and len(masters) != groups:
            raise FormatError(
                f"{arch.label}: {names.masters} holds {len(masters)} flat partitions, but the "
                f"checkpoint describes {groups} {names.group}s (param_shapes and the optimizer's "
                f"param groups); a partition of no described group would be lost"
            )
        count = osd.get("partition_count") if plain else None
        counts = count if isinstance(count, list) else [count] if count is not None else []
        if any(type(c) is not int or c != ranks.world_size for c in counts) or (
            stage < 3 and isinstance(count, list) and len(count) != groups
        ):
            raise FormatError(
                f"{arch.label}: partition_count is {str(count)[:80]}, expected "
                f"{[ranks.world_size] * groups if stage < 3 else ranks.world_size} (one partition "
                f"per optim-states file: there are {ranks.world_size})"
            )


def _module_and_buffers(
    index: CheckpointIndex, stage: int, buffers: list[str], archive: Archive, m0: dict, label: str
) -> str:
    """Buffers as `model.<name>`, the module's weights as `ds_module.<name>`; their precision."""
    module = entry(m0, "module", label)
    if not isinstance(module, dict):
        raise FormatError(f"{label}: 'module' is not a state dict")
    precision = "float32"
    buffer_names = set(buffers)  # a module has a name per parameter: no list scan for each
    for name, ref in module.items():
        if not isinstance(ref, TensorRef):
            continue
        if stage == 3 and name not in buffer_names and empty_view(ref):
            continue  # ZeRO-3 placeholder for a partitioned parameter: nothing of it to locate
        dtype, loc, shape = tensor_of(archive, ref, f"module[{name}]")
        if name in buffer_names:
            index.add_tensor(
                TensorEntry(
                    model_key(name),
                    dtype,
                    shape,
                    [Piece(Box.whole(shape), loc)],
                    path=model_path(name),
                    attrs={"ds_role": "buffer"},
                )
            )
        elif math.prod(shape) == 0 and stage == 3:
            continue  # ZeRO-3 placeholder for a partitioned parameter
        else:
            if dtype in ("float16", "bfloat16"):
                precision = dtype
            index.add_tensor(
                TensorEntry(f"ds_module.{name}", dtype, shape, [Piece(Box.whole(shape), loc)], path=("ds_module", name))
            )
    return precision


def _frozen(
    index: CheckpointIndex,
    stage: int,
    world: int,
    files: ZeroFiles,
    archives: dict[str, Archive],
    model: dict[int, Any],
    label: str,
) -> dict[str, tuple[int, ...]]:
    """Frozen params' shapes as saved; at stage 2/3 their fragments become `model.<name>`."""
    m0 = model[min(model)]
    shapes = m0.get("frozen_param_shapes") or {}
    frozen = {name: shape_of(s, f"{label}: frozen_param_shapes[{name}]") for name, s in shapes.items()}
    if stage == 1:
        # stage 1 keeps frozen params only in `module`: every module tensor that is neither a
        # buffer nor optimizer-owned (decided after the groups are known, in _stage1_frozen)
        return frozen
    for name, shape in frozen.items():
        if stage == 2:
            rel = files.prefix + files.model_files[min(files.model_files)]
            dtype, pieces = _stage2_fragment(archives[rel], m0, name, shape, label)
        else:
            dtype, pieces = _stage3_fragments(files, archives, model, name, shape, world)
        if stage == 3 and len(model) < world:  # a rank's file was missing (verify listed it)
            problems.tolerate_keys([model_key(name)])
        index.add_tensor(
            TensorEntry(model_key(name), dtype, shape, pieces, path=model_path(name), attrs={"ds_role": "frozen"})
        )
    return frozen


def _stage2_fragment(
    archive: Archive, m0: dict, name: str, shape: tuple[int, ...], label: str
) -> tuple[str, list[Piece]]:
    """A stage-2 frozen param: whole, in the one model-states file."""
    numel = math.prod(shape)
    frag = entry(m0.get("frozen_param_fragments") or {}, name, f"{label}: frozen_param_fragments")
    dtype, loc, fshape = tensor_of(archive, frag, f"frozen_param_fragments[{name}]")
    if tuple(fshape) != tuple(shape):  # zero_to_fp32 takes the fragment as it is: its shape must agree
        raise FormatError(
            f"{label}: frozen fragment {name} has shape {list(fshape)}, frozen_param_shapes says {list(shape)}"
        )
    return dtype, [Piece(FlatRange(0, numel), loc)]


def _stage3_fragments(
    files: ZeroFiles, archives: dict[str, Archive], model: dict[int, Any], name: str, shape: tuple[int, ...], world: int
) -> tuple[str | None, list[Piece]]:
    """A stage-3 frozen param: slice r of it in rank r's model-states file."""
    numel = math.prod(shape)
    per = partition.stage3_slice(numel, world)
    dtype, pieces = None, []
    for rank, state in sorted(model.items()):
        rel = files.prefix + files.model_files[rank]
        frags = state.get("frozen_param_fragments") or {}
        frag = entry(frags, name, f"{archives[rel].label}: frozen_param_fragments")
        dtype, loc, fshape = tensor_of(archives[rel], frag, f"frozen_param_fragments[{name}]")
        start = rank * per
        length = max(0, min(per, numel - start))
        if math.prod(fshape) < length:
            raise FormatError(
                f"{archives[rel].label}: frozen fragment {name} holds {math.prod(fshape)} "
                f"elements, rank {rank} needs {length}"
            )
        if length:
            item = loc.length // max(1, math.prod(fshape))
            pieces.append(Piece(FlatRange(start, length), Location(loc.file, loc.offset, length * item)))
    return dtype, pieces


def stage12_groups(osd0: dict, param_shapes: list, label: str) -> tuple[list, list[ZeroGroup]]:
    """(torch param groups, ZeRO groups): at stage 1/2 one flat group per param group."""
    paddings = osd0.get("param_alignment_paddings")
    groups_meta = entry(entry(osd0, "base_optimizer_state", label), "param_groups", label)
    if len(param_shapes) != len(groups_meta):
        raise FormatError(f"{label}: {len(groups_meta)} optimizer groups but param_shapes lists {len(param_shapes)}")
    groups = []
    for g, shapes in enumerate(param_shapes):
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        groups.append(
            ZeroGroup(index=g, param_group=g, params=_params(g, shapes), paddings=tuple(pads) if pads else None)
        )
    return groups_meta, groups


def _stage3_groups(osd0: dict, param_shapes: list, label: str) -> tuple[list, list[ZeroGroup]]:
    """(torch param groups, ZeRO sub-groups): at stage 3 each param group names its sub-groups."""
    groups_meta = entry(entry(osd0, "optimizer_state_dict", label), "param_groups", label)
    sub_to_group = {int(sub): g for g, meta in enumerate(groups_meta) for sub in meta.get("params", [])}
    if sorted(sub_to_group) != list(range(len(param_shapes))):
        raise FormatError(
            f"{label}: optimizer param groups name sub-groups {sorted(sub_to_group)}, "
            f"param_shapes lists {len(param_shapes)}"
        )
    return groups_meta, [
        ZeroGroup(index=i, param_group=sub_to_group[i], params=_params(i, shapes))
        for i, shapes in enumerate(param_shapes)
    ]


def _params(i: int, shapes: dict) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) per parameter; the place for a message is written only for a shape that needs one."""
    return tuple((n, plain_shape(s) or shape_of(s, f"param_shapes[{i}][{n}]")) for n, s in shapes.items())


def _stage1_frozen(
    index: CheckpointIndex, groups: list[ZeroGroup], buffers: list[str], shared: dict[str, str]
) -> dict[str, tuple[int, ...]]:
    """Stage 1: every module tensor that is neither a buffer nor optimizer-owned is frozen."""
    owned = {name for group in groups for name in group.names} | set(buffers) | set(shared)
    frozen = {}
    for key in [k for k in index.tensors if k.startswith("ds_module.")]:
        name = key[len("ds_module.") :]
        if name not in owned:
            e = index.tensors[key]
            frozen[name] = e.shape
            index.add_tensor(
                TensorEntry(
                    model_key(name),
                    e.dtype,
                    e.shape,
                    list(e.pieces),
                    path=model_path(name),
                    attrs={"ds_role": "frozen"},
                )
            )
    return frozen


def _aliases(index: CheckpointIndex, shared: dict[str, str], label: str) -> None:
    """Tied parameters (shared_params) as aliases of their owner's entry. A tied name the
    checkpoint also holds as a parameter, frozen parameter or buffer of its own is two records of
    one tensor (zero_to_fp32 overwrites the held values with the owner's): refused."""
    for alias, owner in shared.items():
        if model_key(owner) in index.tensors and model_key(alias) in index.tensors:
            raise FormatError(
                f"{label}: shared_params ties {quote(str(alias))} to {quote(str(owner))}, but the "
                f"checkpoint also holds {quote(str(alias))} itself; one of the two records is wrong"
            )
        if model_key(owner) in index.tensors:
            target = index.tensors[model_key(owner)]
            index.add_tensor(
                TensorEntry(
                    model_key(alias),
                    target.dtype,
                    target.shape,
                    list(target.pieces),
                    path=model_path(alias),
                    attrs={"alias_of": model_key(owner)},
                )
            )


def _tolerate_missing_models(source: Source, files: ZeroFiles, world: int) -> bool:
    """ZeRO-3 model-states files missing for some ranks: listed when verify collects (True)."""
    if not problems.collecting_now():
        return False
    for rank in range(world):
        if rank not in files.model_files:
            name = files.prefix + zero_model_file(rank, files.mp_rank)
            problems.tolerate(
                FormatError(f"{source.label(name)}: file is missing (rank {rank} of {world})"), source.label(name)
            )
    return True


def _truncated_zip(source: Source, rel: str) -> bool:
    """A file that starts as a zip archive but has no end record: it was cut short."""
    try:
        size = source.size(rel)
        if size < 4 or source.read(rel, 0, 4) != b"PK\x03\x04":
            return False
        tail = min(size, (1 << 16) + 22)
        return b"PK\x05\x06" not in source.read(rel, size - tail, tail)
    except CkptkitError:
        return False


def add_param_groups(index: CheckpointIndex, groups_meta: list, groups: list[ZeroGroup]) -> None:
    """Each torch param group's hyperparameters; `params` lists its parameters by name."""
    names: list[list[str]] = [[] for _ in groups_meta]
    for group in groups:
        names[group.param_group].extend(group.names)
    for g, meta in enumerate(groups_meta):
        for key, value in meta.items():
            if key == "params":
                value = names[g]
            index.add_object(ObjectEntry(param_group_key(g, key), value, path=param_group_path(g, key)))


def add_objects(index: CheckpointIndex, stage: int, archive: Archive, m0: dict, o0: dict) -> None:
    items = [(key, value) for key, value in m0.items() if key not in STRUCTURAL_KEYS]
    values = materialize([value for _, value in items], archive)  # one shared read per storage for them all
    for (key, _), value in zip(items, values):
        container = "ds" if key in DS_KEYS else "client"
        index.add_object(ObjectEntry(f"{container}.{key}", value, path=(container, key)))
    osd = o0["optimizer_state_dict"]
    for key in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad"):
        if key in osd:
            index.add_object(ObjectEntry(f"ds.{key}", osd[key], path=("ds", key)))
    index.add_object(ObjectEntry("ds.zero_stage", stage, path=("ds", "zero_stage")))
