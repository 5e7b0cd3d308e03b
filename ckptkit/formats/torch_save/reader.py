"""Index a torch.save file (FSDP FULL_STATE_DICT, `model.state_dict()`, `{"model":..,"optim":..}`).

The pickle is run through the restricted unpickler with lazy storages, so a multi-GB file costs
a few small reads: each tensor becomes one piece pointing at its storage bytes, with its strides.
Tensors sharing a storage (tied weights) point at the same bytes.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import FormatError
from ...index import geometry
from ...index.flatten import flatten, key_of
from ...index.types import Box, CheckpointIndex, ObjectEntry, Piece, TensorEntry
from ...safeload import TensorRef
from ...storage.source import Source
from ...torch_types import SmallTensor
from .archive import Archive, open_archive, load_structure, tensor_location

FORMAT = "torch_save"


def read_index(source: Source, rel: str) -> CheckpointIndex:
    archive = open_archive(source, rel)
    structure = load_structure(archive, eager=False)
    index = CheckpointIndex(format=FORMAT, root=source.root, world_size=1)
    index.files[rel] = source.size(rel)
    index.checks.extend(archive.checks())
    try:
        add_structure(index, archive, structure, prefix=())
    except RecursionError:
        raise FormatError(f"{archive.label}: the state dict is nested too deeply (or refers to "
                          f"itself) to be a checkpoint") from None
    return index


def add_structure(index: CheckpointIndex, archive: Archive, structure: Any, prefix: tuple) -> None:
    """Add every leaf of an unpickled structure: TensorRefs as tensors, the rest as objects."""
    if isinstance(structure, TensorRef):
        leaves = [(prefix, structure)] if prefix else [(("",), structure)]
    elif isinstance(structure, Mapping):
        leaves = [(prefix + p, v) for p, v in flatten(structure, lambda v: isinstance(v, TensorRef))]
    else:
        raise FormatError(f"{archive.label}: expected a state dict (a mapping) at the top level, "
                          f"found {type(structure).__name__}")
    for path, value in leaves:
        key = key_of(path)
        if isinstance(value, TensorRef):
            dtype, loc = tensor_location(archive, value, key)
            index.add_tensor(TensorEntry(key, dtype, tuple(value.size),
                                         [Piece(Box.whole(tuple(value.size)), loc)], path=path))
        else:
            index.add_object(ObjectEntry(key, materialize(value, archive), path=path))


def materialize(value: Any, archive: Archive) -> Any:
    """Replace TensorRefs nested in a non-tensor value (a step, a tuple of tensors, ...) by
    SmallTensors holding their bytes (ObjectEntry.value gives them as torch tensors)."""
    if isinstance(value, TensorRef):
        dtype, loc = tensor_location(archive, value, "nested tensor")
        raw = archive.source.read(loc.file, loc.offset, loc.length)
        size = tuple(value.size)
        stride = loc.stride if loc.stride is not None else geometry.row_major_strides(size)
        return SmallTensor.from_storage(dtype, raw, 0, size, stride)
    if isinstance(value, dict):
        return type(value)((k, materialize(v, archive)) for k, v in value.items()) if type(value) is not dict \
            else {k: materialize(v, archive) for k, v in value.items()}
    if isinstance(value, list):
        return [materialize(v, archive) for v in value]
    if type(value) is tuple:
        return tuple(materialize(v, archive) for v in value)
    return value
