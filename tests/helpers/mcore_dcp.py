"""torch's own view of a torch_dist (DCP) folder, for tests on what ckptkit writes for Megatron-Core:
its global tensors as torch.distributed.checkpoint loads them, and where each chunk was written."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

RANK_FILE = re.compile(r"__([0-9]+)_[0-9]+\.distcp")


def metadata(folder: Path):
    return dcp.FileSystemReader(str(folder)).read_metadata()


def global_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder whole, as dcp.load fills it (one process, no process group); what
    no chunk covers (gaps in the distributed optimizer's flat buffers) reads as zeros."""
    md = metadata(folder)
    state = {
        key: torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in md.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def chunks_by_rank(folder: Path) -> dict[str, set[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
    """For each tensor key, its chunks as (writing rank, offsets, sizes): the rank from the file name."""
    md = metadata(folder)
    sizes = {}
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            for chunk in meta.chunks:
                sizes[(key, tuple(chunk.offsets))] = tuple(chunk.sizes)
    out: dict[str, set] = {}
    for index, info in md.storage_data.items():
        if index.offset is None:
            continue
        rank = int(RANK_FILE.fullmatch(info.relative_path).group(1))
        offsets = tuple(index.offset)
        out.setdefault(index.fqn, set()).add((rank, offsets, sizes[(index.fqn, offsets)]))
    return out
