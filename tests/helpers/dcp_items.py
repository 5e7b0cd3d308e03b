"""What torch itself reads from a DCP folder (FileSystemReader's metadata, each item by torch.load):
the ground truth a folder ckptkit wrote is compared with."""

from __future__ import annotations

import io

import torch


def dcp_items(path) -> tuple[list[str], dict[str, list], dict]:
    """What torch reads from a DCP folder: the metadata's key order, each tensor's chunk list
    [(offsets, sizes, file)] in order, and every item's value by (key, offsets), read from its file
    with torch.load."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    chunks: dict[str, list] = {}
    values: dict = {}

    def load(info):
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            return torch.load(io.BytesIO(f.read(info.length)), weights_only=False)

    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            chunks[key] = []
            for i, c in enumerate(meta.chunks):
                info = md.storage_data[MetadataIndex(key, c.offsets, i)]
                chunks[key].append((tuple(c.offsets), tuple(c.sizes), info.relative_path))
                values[(key, tuple(c.offsets))] = load(info)
        else:
            info = md.storage_data[MetadataIndex(key)]
            chunks[key] = [(None, None, info.relative_path)]
            values[(key, None)] = load(info)
    return list(md.state_dict_metadata), chunks, values
