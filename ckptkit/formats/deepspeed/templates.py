"""The structures a ZeRO checkpoint is written from: the source's own pickles (or the ones convert
built), their tensors turned into lazily read ones, their key order kept."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ...index.types import Box, Piece, TensorEntry
from ...safeload import TensorRef
from ...runner.torch_archive import Archive, tensor_location
from ..torch_save.archive_writer import LazyTensor
from .info import ZeroInfo


def lazify(value: Any, archive: Archive, cache: dict) -> Any:
    """Replace TensorRefs of a template structure by LazyTensors reading the same bytes. `cache`:
    TensorRef -> its LazyTensor (equal refs, one tensor), and shape -> its whole Box."""
    if isinstance(value, TensorRef):
        hit = cache.get(value)
        if hit is None:
            dtype, loc = tensor_location(archive, value, "tensor")
            shape = tuple(value.size)
            box = cache.get(shape)  # one (immutable) Box per shape: a module's placeholders share a few
            if box is None:
                box = cache[shape] = Box.whole(shape)
            entry = TensorEntry(f"{archive.file}:{value.storage.key}", dtype, shape, [Piece(box, loc)])
            hit = cache[value] = LazyTensor(entry)
        return hit
    if isinstance(value, OrderedDict):
        return OrderedDict((k, lazify(v, archive, cache)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: lazify(v, archive, cache) for k, v in value.items()}
    if isinstance(value, list):
        return [lazify(v, archive, cache) for v in value]
    if type(value) is tuple:
        return tuple(lazify(v, archive, cache) for v in value)
    return value


def template_of(info: ZeroInfo, kind: str, rank: int) -> tuple[Any, Archive]:
    files = info.files.model_files if kind == "model" else info.files.optim_files
    rel = info.files.prefix + files[rank]
    states = info.model_states if kind == "model" else info.optim_states
    return states[rank], info.archives.get(rel)  # no archive: a template convert built


def ordered_like(template: dict, values: dict) -> dict:
    """Keep the template's key order (DeepSpeed does not care, humans diffing files do)."""
    out = {k: values[k] for k in template if k in values}
    out.update({k: v for k, v in values.items() if k not in out})
    return out
