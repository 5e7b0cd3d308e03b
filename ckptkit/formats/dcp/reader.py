"""Index a torch.distributed.checkpoint folder without torch.load or plain pickle.

`.metadata` (or the rank-local `__{rank}.metadata` files) is unpickled by the restricted loader
into inert stand-ins; each tensor chunk is a torch.save archive inside a `.distcp` file, whose zip
directory we parse to find the exact bytes of the chunk. Bytes items (non-tensor values) are
loaded through the restricted loader as objects, keeping their location for verbatim copies.
"""
from __future__ import annotations

import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ...errors import FormatError
from ...index.dtypes import dtype_name
from ...index.types import Box, CheckpointIndex, Location, ObjectEntry, Piece, TensorEntry
from ...runner import codecs
from ...safeload import Inert, TensorRef, restricted_loads
from ...storage.source import Source
from ..torch_save.archive import load_bytes_archive, load_structure, open_archive, tensor_location
from ..torch_save.reader import materialize

FORMAT = "dcp"
METADATA = ".metadata"
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def metadata_files(source: Source) -> list[str]:
    names = source.listdir("")
    if METADATA in names:
        return [METADATA]
    ranked = sorted((int(m.group(1)), n) for n in names if (m := _RANK_METADATA.match(n)))
    return [n for _, n in ranked]


def detect(source: Source) -> bool:
    return source.isdir("") and bool(metadata_files(source))


def _field(obj: Any, name: str, what: str, label: str, default: Any = ...) -> Any:
    if isinstance(obj, Inert) or hasattr(obj, "__dict__"):
        if name in obj.__dict__:
            return obj.__dict__[name]
    if default is not ...:
        return default
    raise FormatError(f"{label}: {what} has no field {name!r} (not DCP metadata?)")


def _props_dtype(props: Any, label: str, key: str) -> torch.dtype:
    dtype = props.__dict__.get("dtype") if hasattr(props, "__dict__") else None
    if dtype is None:
        state = getattr(props, "__dict__", {}).get("_state")
        if isinstance(state, tuple) and state:
            dtype = state[0]
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{label}: tensor {key} has no dtype in its properties")
    return dtype


def _load_metadata(source: Source, name: str) -> Any:
    label = source.label(name)
    md = restricted_loads(source.read(name, 0, source.size(name)), label)
    if type(md).__name__ != "Metadata" or not isinstance(getattr(md, "__dict__", {}).get("state_dict_metadata"), dict):
        raise FormatError(f"{label}: not a DCP Metadata object (found {type(md).__name__})")
    return md


def _safe_relpath(path: Any, label: str) -> str:
    path = str(path)
    norm = posixpath.normpath(path)
    if not path or posixpath.isabs(path) or "\\" in path or ".." in norm.split("/"):
        raise FormatError(f"{label}: storage record points outside the checkpoint folder ({path!r})")
    return norm


def read_index(source: Source, parallel: int = 8) -> CheckpointIndex:
    names = metadata_files(source)
    if not names:
        raise FormatError(f"{source.label('')}: no .metadata file (incomplete or not a DCP checkpoint)")
    sd_meta: dict[str, Any] = {}
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    storage: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    planner: dict[str, Any] = {}
    versions = set()
    save_id = None
    for name in names:
        label = source.label(name)
        md = _load_metadata(source, name)
        versions.add(_field(md, "version", "Metadata", label, None))
        sm = _field(md, "storage_meta", "Metadata", label, None)
        if sm is not None:
            save_id = getattr(sm, "__dict__", {}).get("save_id", save_id)
        for key, meta in _field(md, "state_dict_metadata", "Metadata", label).items():
            sd_meta.setdefault(key, meta)
            if type(meta).__name__ == "TensorStorageMetadata":
                seen = chunks.setdefault(key, [])
                for ch in _field(meta, "chunks", f"tensor {key}", label):
                    box = (tuple(int(x) for x in _field(ch, "offsets", "chunk", label)),
                           tuple(int(x) for x in _field(ch, "sizes", "chunk", label)))
                    if box not in seen:
                        seen.append(box)
        for mi, info in (_field(md, "storage_data", "Metadata", label, None) or {}).items():
            fqn = _field(mi, "fqn", "MetadataIndex", label)
            off = _field(mi, "offset", "MetadataIndex", label, None)
            storage.setdefault((fqn, tuple(int(x) for x in off) if off is not None else None), info)
        planner.update(_field(md, "planner_data", "Metadata", label, None) or {})

    index = CheckpointIndex(format=FORMAT, root=source.root)
    index.metadata["dcp_version"] = sorted(v for v in versions if v) or None
    index.metadata["metadata_files"] = names
    if save_id:
        index.metadata["save_id"] = save_id
    for name in source.listdir(""):
        if _DATA_FILE.match(name) or name in names:
            index.files[name] = source.size(name)

    jobs = []
    for key, meta in sd_meta.items():
        path = tuple(planner[key]) if isinstance(planner.get(key), (tuple, list)) else None
        label = source.label(names[0])
        kind = type(meta).__name__
        if kind == "TensorStorageMetadata":
            dtype = _props_dtype(_field(meta, "properties", f"tensor {key}", label), label, key)
            shape = tuple(int(x) for x in _field(meta, "size", f"tensor {key}", label))
            entry = TensorEntry(key, dtype_name(dtype), shape, [], path=path)
            index.add_tensor(entry)
            for offsets, sizes in chunks[key]:
                info = storage.get((key, offsets))
                if info is None:
                    raise FormatError(f"{label}: tensor {key} chunk at offsets {list(offsets)} has no storage record")
                jobs.append((entry, Box(offsets, sizes), info))
        elif kind == "BytesStorageMetadata":
            info = storage.get((key, None))
            if info is None:
                raise FormatError(f"{label}: value {key} has no storage record")
            jobs.append((ObjectEntry(key, None, path=path), None, info))
        else:
            raise FormatError(f"{label}: key {key} has unknown storage metadata {kind}")

    def run(job):
        return _read_item(source, *job)

    if parallel > 1 and len(jobs) > 8:
        with ThreadPoolExecutor(parallel) as pool:
            results = list(pool.map(run, jobs))
    else:
        results = [run(j) for j in jobs]
    for (target, _, _), (piece_or_value, checks) in zip(jobs, results):
        if isinstance(target, TensorEntry):
            target.pieces.append(piece_or_value)
        else:
            target.value, target.location = piece_or_value
            index.add_object(target)
        index.checks.extend(checks)
    ranks = [int(m.group(1)) for n in index.files if (m := _DATA_FILE.match(n))]
    index.world_size = max(ranks) + 1 if ranks else None
    return index


def _read_item(source: Source, target: Any, box: Box | None, info: Any):
    label = source.label("")
    rel = _safe_relpath(_field(info, "relative_path", "_StorageInfo", label), label)
    offset = int(_field(info, "offset", "_StorageInfo", label))
    length = int(_field(info, "length", "_StorageInfo", label))
    transforms = tuple(_field(info, "transform_descriptors", "_StorageInfo", label, None) or ())
    size = source.size(rel)
    if offset < 0 or length < 0 or offset + length > size:
        raise FormatError(f"{source.label(rel)}: item of {target.key} at bytes {offset}..{offset + length} "
                          f"lies past the end of the file ({size} bytes; truncated?)")
    if isinstance(target, TensorEntry):
        if transforms:
            return Piece(box, Location(rel, offset, length, "torch_save", transforms=transforms)), []
        archive = open_archive(source, rel, offset, length)
        ref = load_structure(archive, eager=False)
        if not isinstance(ref, TensorRef):
            raise FormatError(f"{source.label(rel)}: item of {target.key} does not hold a tensor")
        dtype, loc = tensor_location(archive, ref, target.key)
        if dtype != target.dtype or tuple(ref.size) != box.sizes:
            raise FormatError(f"{source.label(rel)}: item of {target.key} holds {dtype} {list(ref.size)}, "
                              f"metadata says {target.dtype} {list(box.sizes)}")
        return Piece(box, loc), archive.checks()
    raw = source.read(rel, offset, length)
    data = codecs.decode(raw, transforms, f"{source.label(rel)} (value {target.key})")
    if data[:4] == b"PK\x03\x04":
        value = load_bytes_archive(data, f"{source.label(rel)} (value {target.key})")
        encoding = "torch_save"
    else:
        value = data  # a raw io.BytesIO value saved as is
        encoding = "bytes"
    return (value, Location(rel, offset, length, encoding, transforms=transforms)), []
