"""Index a torch.save file (FSDP FULL_STATE_DICT, `model.state_dict()`, `{"model":..,"optim":..}`).

The pickle is run through the restricted unpickler with lazy storages, so a multi-GB file costs
a few small reads: each tensor becomes one piece pointing at its storage bytes, with its strides.
Tensors sharing a storage (tied weights) point at the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import FormatError
from ...index.flatten import flatten, key_of
from ...index.types import Box, CheckpointIndex, NameCollision, ObjectEntry, Piece, TensorEntry
from ...safeload import TensorRef
from ...storage.source import Source
from ..structure import STATE_DICT_KEYS
from ...runner.torch_archive import Archive, load_structure, load_values, open_archive, tensor_location

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
        raise FormatError(
            f"{archive.label}: the state dict is nested too deeply (or refers to itself) to be a checkpoint"
        ) from None
    except NameCollision as e:
        raise FormatError(f"{archive.label}: {e.detail}") from None
    return index


def add_structure(index: CheckpointIndex, archive: Archive, structure: Any, prefix: tuple) -> None:
    """Add every leaf of an unpickled structure: TensorRefs as tensors, the rest as objects."""
    if isinstance(structure, TensorRef):
        leaves = [(prefix, structure)] if prefix else [(("",), structure)]
    elif isinstance(structure, Mapping):
        _check_state_dicts(structure, archive.label)
        leaves = [(prefix + p, v) for p, v in flatten(structure, lambda v: isinstance(v, TensorRef))]
    else:
        raise FormatError(
            f"{archive.label}: expected a state dict (a mapping) at the top level, found {type(structure).__name__}"
        )
    values: list[tuple[tuple, Any]] = []
    for path, value in leaves:
        key = key_of(path)
        if isinstance(value, TensorRef):
            dtype, loc = tensor_location(archive, value, key)
            index.add_tensor(
                TensorEntry(key, dtype, tuple(value.size), [Piece(Box.whole(tuple(value.size)), loc)], path=path)
            )
        else:
            values.append((path, value))
    loaded = materialize([v for _, v in values], archive)  # one shared read per storage for them all
    for (path, _), value in zip(values, loaded):
        index.add_object(ObjectEntry(key_of(path), value, path=path))


def _check_state_dicts(structure: Mapping, label: str) -> None:
    """A state dict nested under a known key must be a mapping: a list of tensors there would be
    read as parameters named 0, 1, ..., which no model has."""
    for key in STATE_DICT_KEYS:
        value = structure.get(key)
        if isinstance(value, (list, tuple)):
            raise FormatError(
                f"{label}: {key!r} is a {type(value).__name__} of {len(value)} values, expected "
                f"a mapping of parameter names to tensors (a state dict)"
            )


def materialize(value: Any, archive: Archive) -> Any:
    """Replace TensorRefs nested in a non-tensor value (a step, a tuple of tensors, ...) by
    SmallTensors over their bytes (ObjectEntry.value gives them as torch tensors); views of one
    storage share one read of it (archive.load_values)."""
    return load_values(archive, value)
