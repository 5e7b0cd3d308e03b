"""Index a DeepSpeed universal checkpoint (ds_to_universal's output, or ckptkit's) in torch's
recipe keys, the way a torch.save `{"model": ..., "optim": ...}` file reads.

Every .pt file is read by the torch.save reader (the restricted unpickler, lazy storages): each
parameter's fp32 master and optimizer states become `model.<name>` and
`optim.state.<name>.<key>` entries pointing at their bytes in zero/<name>/<key>.pt; the param
groups come from zero/optimizer_state.pt, their members (by name) and the parameters' shapes
from the model-states file's `param_shapes`, which every state file is checked against. The
model-states file also gives the buffers and frozen parameters (the engine's `module`), the
tied names (`shared_params`), DeepSpeed's counters (`ds.*`) and the client state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ...errors import FormatError, name_of
from ...index.state_keys import model_key, model_path, param_group_key, param_group_path, state_key, state_path
from ...index.dtypes import itemsize
from ...index.types import Box, FlatRange, CheckpointIndex, Encoding, ObjectEntry, Piece, TensorEntry
from ...runner.torch_archive import load_structure, open_archive
from ...storage.source import Source
from ...torch_types import SmallTensor
from ..deepspeed.reader import DS_KEYS, STRUCTURAL_KEYS
from ..deepspeed.standins import enum_value
from ..torch_save import reader as ts_reader
from .layout import FP32, OPTIMIZER_STATE, PARAM, STEP, ZERO, join, model_state_files, tag_folder

FORMAT = "ds_universal"
OWN_KEYS = frozenset(DS_KEYS | STRUCTURAL_KEYS)  # the model-states keys DeepSpeed writes (the rest: client state)


def read_index(source: Source, tag: str | None = None) -> CheckpointIndex:
    folder = tag_folder(source, tag)
    index = CheckpointIndex(format=FORMAT, root=source.root, world_size=1)
    models_rel = join(folder, model_state_files(source, folder)[0])
    models = _read_file(source, models_rel, index)
    top = _top_level(source, models_rel)
    optim_rel = join(folder, ZERO, OPTIMIZER_STATE)
    optim = _read_file(source, optim_rel, index)
    groups = _param_shapes(top, models_rel)
    shapes = {name: shape for group in groups for name, shape in group.items()}
    zero_step = _object(optim, ("optimizer_state_dict", "state", 0, "step"))
    if zero_step is None:  # the reader writes a dict's int keys as text
        zero_step = _object(optim, ("optimizer_state_dict", "state", "0", "step"))
    for name, shape in shapes.items():
        _add_parameter(index, source, join(folder, ZERO, name), name, shape, zero_step)
    _add_module(index, models, top, shapes)
    _add_frozen_fragments(index, source, folder, models, top)
    _add_groups(index, optim, groups, optim_rel)
    _add_objects(index, top)
    index.metadata["ds_universal"] = {"tag": folder or None, "model_states": models_rel}
    index.step = _int_or_none(top.get("global_steps"))
    return index


def _read_file(source: Source, rel: str, index: CheckpointIndex) -> CheckpointIndex:
    """One .pt file's index (restricted unpickler); its size and checks join the checkpoint's."""
    if not source.exists(rel) or source.isdir(rel):
        raise FormatError(f"{source.label(rel)}: missing; a universal checkpoint needs it")
    one = ts_reader.read_index(source, rel)
    index.files[rel] = one.files[rel]
    index.checks.extend(one.checks)
    return one


def _object(one: CheckpointIndex, path: tuple) -> Any:
    for o in one.objects.values():
        if o.path is not None and tuple(o.path) == path:
            return o.data
    return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _top_level(source: Source, rel: str) -> dict[str, Any]:
    """The model-states file's top-level values (tensors left as references, small values read)."""
    archive = open_archive(source, rel)
    structure = load_structure(archive, eager=False)
    if not isinstance(structure, Mapping):
        raise FormatError(f"{rel}: expected a dict of DeepSpeed's model states, found {type(structure).__name__}")
    keys = [k for k in structure if k != "module"]
    values = ts_reader.materialize([structure[k] for k in keys], archive)
    return dict(zip(keys, values))


def _param_shapes(top: dict[str, Any], rel: str) -> list[dict[str, tuple[int, ...]]]:
    """Each param group's {name: shape}, from the model-states file's `param_shapes`."""
    groups = top.get("param_shapes")
    if not isinstance(groups, (list, tuple)) or not groups or not all(isinstance(g, Mapping) for g in groups):
        raise FormatError(f"{rel}: has no param_shapes (a list of {{name: shape}} per param group), expected one")
    return [
        {str(n): _shape(v, f"{rel}: param_shapes[{g}][{name_of(str(n))}]") for n, v in group.items()}
        for g, group in enumerate(groups)
    ]


def _shape(value: Any, where: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in value)
    except (TypeError, ValueError):
        raise FormatError(f"{where}: expected a shape (a list of sizes), found {type(value).__name__}") from None
    if any(x < 0 for x in shape):
        raise FormatError(f"{where}: expected a shape of sizes >= 0, found {list(shape)}")
    return shape


def _add_parameter(
    index: CheckpointIndex, source: Source, folder: str, name: str, shape: tuple, zero_step: Any
) -> None:
    """zero/<name>/: fp32.pt as `model.<name>`, every other state file as its optimizer state."""
    files = sorted(n for n in source.listdir(folder) if n.endswith(".pt")) if source.isdir(folder) else []
    if f"{FP32}.pt" not in files:
        raise FormatError(
            f"{source.label(join(folder, FP32 + '.pt'))}: missing; every parameter's folder holds its fp32 master"
        )
    for file in files:
        key, rel = file[: -len(".pt")], join(folder, file)
        if key == STEP:
            index.add_object(
                ObjectEntry(state_key(name, STEP), _read_step(source, rel, index), path=state_path(name, STEP))
            )
            continue
        one = _read_file(source, rel, index)
        entry = _shaped(_state_tensor(one, rel), shape, name, rel)
        if key == FP32:
            index.add_tensor(
                replace(entry, key=model_key(name), path=model_path(name), attrs={"ds_role": "fp32_master"})
            )
        else:
            index.add_tensor(replace(entry, key=state_key(name, key), path=state_path(name, key), attrs={}))
    if STEP + ".pt" not in files and zero_step is not None and len(files) > 1:  # ZeRO 3: one step in the global state
        index.add_object(ObjectEntry(state_key(name, STEP), zero_step, path=state_path(name, STEP)))


def _state_tensor(one: CheckpointIndex, rel: str) -> TensorEntry:
    """The tensor of a state file: {"param": tensor, ...} (ZeRO 1/2) or the tensor itself (ZeRO 3)."""
    for key in (PARAM, ""):
        if key in one.tensors:
            return one.tensors[key]
    raise FormatError(f"{rel}: expected a tensor or a dict with a {PARAM!r} tensor, found none")


def _shaped(entry: TensorEntry, shape: tuple, name: str, rel: str) -> TensorEntry:
    """`entry` as the parameter's shape: ZeRO 3's files hold it flat (DeepSpeed views them so)."""
    if tuple(entry.shape) == tuple(shape):
        return entry
    piece = entry.pieces[0] if len(entry.pieces) == 1 else None
    flat = len(entry.shape) == 1 and piece is not None and piece.location.stride in (None, (1,))
    if not flat or entry.numel != math.prod(shape) or piece.location.encoding != Encoding.RAW:
        raise FormatError(
            f"{rel}: holds a tensor of shape {list(entry.shape)}, but the model states say "
            f"{name_of(name)} has shape {list(shape)}"
        )
    loc = replace(piece.location, stride=None)
    return replace(entry, shape=tuple(shape), pieces=[Piece(Box.whole(tuple(shape)), loc)])


def _read_step(source: Source, rel: str, index: CheckpointIndex) -> Any:
    """step.pt: the optimizer step as DeepSpeed saved it (a number, or a one-element tensor)."""
    archive = open_archive(source, rel)
    index.files[rel] = source.size(rel)
    index.checks.extend(archive.checks())
    value = load_structure(archive, eager=True)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, SmallTensor) and math.prod(value.shape) == 1:
        return value
    raise FormatError(f"{rel}: expected the optimizer step (a number), found {type(value).__name__}")


def _add_module(index: CheckpointIndex, models: CheckpointIndex, top: dict[str, Any], shapes: dict) -> None:
    """The engine's `module` entries that are not trainable (buffers, frozen parameters) as
    `model.<name>` with their role; tied names (`shared_params`) as aliases of their owner."""
    shared, names = top.get("shared_params"), top.get("buffer_names")
    ties = {str(a): o for a, o in shared.items() if isinstance(o, str)} if isinstance(shared, Mapping) else {}
    buffers = {n for n in names if isinstance(n, str)} if isinstance(names, (list, tuple)) else set()
    for e in models.tensors.values():
        p = tuple(e.path or ())
        if len(p) != 2 or p[0] != "module" or p[1] in shapes:
            continue
        name, owner = p[1], ties.get(p[1])
        if owner is not None and model_key(owner) in index.tensors:
            owner_entry = index.tensors[model_key(owner)]
            attrs = {"alias_of": model_key(owner)}
            index.add_tensor(replace(owner_entry, key=model_key(name), path=model_path(name), attrs=attrs))
        elif e.numel > 0 or name in buffers:  # ZeRO 3 leaves its frozen parameters empty here
            role = "buffer" if name in buffers else "frozen"
            index.add_tensor(replace(e, key=model_key(name), path=model_path(name), attrs={"ds_role": role}))


def _add_frozen_fragments(
    index: CheckpointIndex, source: Source, folder: str, models: CheckpointIndex, top: dict[str, Any]
) -> None:
    """ZeRO 3 keeps frozen parameters as flat fragments, one per rank's model-states file
    (ds_to_universal copies them as they are): each becomes one tensor over those ranges."""
    frozen = top.get("frozen_param_shapes")
    shapes = {
        str(n): _shape(v, f"frozen_param_shapes[{name_of(str(n))}]")
        for n, v in (frozen.items() if isinstance(frozen, Mapping) else ())
        if model_key(str(n)) not in index.tensors
    }
    if not shapes:
        return
    files = model_state_files(source, folder)
    ranks = [models] + [_read_file(source, join(folder, f), index) for f in files[1:]]
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = -(-numel // len(ranks))
        pieces, dtype = [], None
        for r, one in enumerate(ranks):
            e = one.tensors.get(f"frozen_param_fragments.{name}")
            start, length = r * part, max(0, min(part, numel - r * part))
            if e is None or e.numel < length or len(e.pieces) != 1:
                raise FormatError(
                    f"{join(folder, files[r])}: frozen_param_fragments[{name_of(name)}] is missing or short "
                    f"(expected {length} of its {numel} elements)"
                )
            dtype = e.dtype
            loc = e.pieces[0].location
            if length:
                pieces.append(Piece(FlatRange(start, length), replace(loc, length=length * itemsize(e.dtype))))
        entry = TensorEntry(model_key(name), dtype, shape, pieces, path=model_path(name), attrs={"ds_role": "frozen"})
        index.add_tensor(entry)


def _add_groups(index: CheckpointIndex, optim: CheckpointIndex, groups: list[dict], rel: str) -> None:
    """zero/optimizer_state.pt's param_groups, each with its parameters' names."""
    found: dict[int, dict[str, Any]] = {}
    for o in optim.objects.values():
        p = tuple(o.path or ())
        if len(p) >= 3 and p[0] == "param_groups" and isinstance(p[1], int) and p[2] != "params":
            found.setdefault(p[1], {})[p[2]] = o.data if len(p) == 3 else None
    for key, value in _group_lists(optim).items():
        found.setdefault(key[0], {})[key[1]] = value
    if len(found) != len(groups):
        raise FormatError(
            f"{rel}: has {len(found)} param groups, but the model states list {len(groups)} (param_shapes)"
        )
    for g in sorted(found):
        for hyper, value in found[g].items():
            index.add_object(ObjectEntry(param_group_key(g, hyper), value, path=param_group_path(g, hyper)))
        index.add_object(ObjectEntry(param_group_key(g, "params"), list(groups[g]), path=param_group_path(g, "params")))


def _group_lists(optim: CheckpointIndex) -> dict[tuple[int, str], list]:
    """Hyperparameters stored as lists (Adam's betas), flattened by the reader, joined again."""
    lists: dict[tuple[int, str], dict[int, Any]] = {}
    for o in optim.objects.values():
        p = tuple(o.path or ())
        if len(p) == 4 and p[0] == "param_groups" and isinstance(p[1], int) and p[2] != "params":
            lists.setdefault((p[1], p[2]), {})[p[3]] = o.data
    return {k: [v[i] for i in sorted(v)] for k, v in lists.items()}


def _add_objects(index: CheckpointIndex, top: dict[str, Any]) -> None:
    """DeepSpeed's values as `ds.<key>`, the client state as `client.<key>` (as the ZeRO reader
    names them), each whole."""
    for key, value in top.items():
        if key in STRUCTURAL_KEYS:
            continue
        container = "ds" if key in DS_KEYS else "client"
        index.add_object(ObjectEntry(f"{container}.{key}", enum_value(value), path=(container, key)))
