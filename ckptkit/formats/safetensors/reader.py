"""Index safetensors files: one file, a folder of shards with model.safetensors.index.json, or
any folder of *.safetensors. Headers are checked strictly (bounds, sizes, overlaps) because a
safetensors file carries no checksum: the header is all there is to trust."""
from __future__ import annotations

import math
import struct
from typing import Any

from ...errors import FormatError, UnsupportedError, name_of, quote
from ...index.dtypes import from_safetensors, itemsize
from ...safe_json import loads as json_loads
from ...index.types import Box, CheckpointIndex, Location, ObjectEntry, Piece, TensorEntry
from ...storage.source import Source

FORMAT = "safetensors"
INDEX_NAME = "model.safetensors.index.json"
ALIASES_KEY = "ckptkit.aliases"
OBJECTS_KEY = "ckptkit.objects"
MAX_HEADER = 100 * 1024 * 1024


def read_header(source: Source, rel: str) -> tuple[dict[str, Any], int]:
    """The parsed JSON header and the byte offset where the data buffer starts."""
    label = source.label(rel)
    size = source.size(rel)
    if size < 8:
        raise FormatError(f"{label}: {size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", source.read(rel, 0, 8))
    if n > MAX_HEADER or 8 + n > size:
        raise FormatError(f"{label}: header length {n} does not fit the file ({size} bytes)")
    header = json_loads(source.read(rel, 8, n), label, "header")
    if not isinstance(header, dict):
        raise FormatError(f"{label}: header is not a JSON object")
    buffer = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise FormatError(f"{label}: __metadata__ must map strings to strings")
            continue
        if not name.isascii():
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate, written \udXXX in the JSON: no loader takes it
                raise FormatError(f"{label}: tensor name {name_of(name)} is not UTF-8 text") from None
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise FormatError(f"{label}: tensor {name_of(name)} lacks dtype, shape or data_offsets")
        shape, offs = info["shape"], info["data_offsets"]
        if (not isinstance(shape, list) or not all(type(d) is int and 0 <= d < _U64 for d in shape)
                or not isinstance(offs, list) or len(offs) != 2
                or not all(type(o) is int for o in offs)):  # (not bool: JSON's true is no dimension)
            raise FormatError(f"{label}: tensor {name_of(name)} has a malformed shape or data_offsets")
        try:
            dtype = from_safetensors(info["dtype"]) if isinstance(info["dtype"], str) else None
        except UnsupportedError:
            dtype = None
        if dtype is None:
            raise FormatError(f"{label}: tensor {name_of(name)} has an unknown dtype {quote(str(info['dtype']))}")
        begin, end = offs
        if not _fits_u64(shape, itemsize(dtype)):
            raise FormatError(f"{label}: tensor {name_of(name)} has shape {shape}, whose size overflows 64 bits")
        expected = math.prod(shape) * itemsize(dtype)
        if not 0 <= begin <= end <= buffer:
            raise FormatError(f"{label}: tensor {name_of(name)} data_offsets {offs} lie outside the "
                              f"{buffer}-byte data buffer")
        if end - begin != expected:
            raise FormatError(f"{label}: tensor {name_of(name)} is {dtype}{shape} ({expected} bytes) but its "
                              f"data_offsets span {end - begin} bytes")
        spans.append((begin, end, name))
    spans.sort()
    reach, holder = 0, None  # the furthest end so far, and whose (an empty tensor between cannot hide it)
    for begin, end, name in spans:
        if end == begin:
            continue
        if begin < reach:
            raise FormatError(f"{label}: tensors {name_of(holder)} and {name_of(name)} overlap in the data buffer")
        reach, holder = end, name
    return header, 8 + n


_U64 = 1 << 64


def _fits_u64(shape: list[int], item: int) -> bool:
    """The element count and byte size stay below 2**64 at every step of their product, as the
    safetensors library computes them (it refuses an overflow even where a later dimension is 0)."""
    count = 1
    for d in shape:
        count *= d
        if count >= _U64:
            return False
    return count * item < _U64


def safetensors_files(source: Source) -> list[str]:
    """The shard files of a folder: from the index JSON when present, else every *.safetensors."""
    names = source.listdir("")
    if INDEX_NAME in names:
        weight_map = read_weight_map(source)
        files = sorted(set(weight_map.values()))
        extra = [n for n in names if n.endswith(".safetensors") and n not in files]
        return files + extra
    return [n for n in names if n.endswith(".safetensors")]


def read_weight_map(source: Source) -> dict[str, str]:
    label = source.label(INDEX_NAME)
    size = source.size(INDEX_NAME)
    if size > MAX_HEADER:
        raise FormatError(f"{label}: {size:,} bytes is too large for a safetensors index")
    doc = json_loads(source.read(INDEX_NAME, 0, size), label, "the index")
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise FormatError(f"{label}: has no weight_map of tensor name -> file")
    for f in set(wm.values()):
        if "/" in f or "\\" in f or f.startswith(".."):
            raise FormatError(f"{label}: weight_map points outside the folder ({quote(f)})")
    return wm


def read_index(source: Source, files: list[str]) -> CheckpointIndex:
    index = CheckpointIndex(format=FORMAT, root=source.root)
    weight_map = read_weight_map(source) if source.isdir("") and INDEX_NAME in source.listdir("") else None
    aliases: dict[str, str] = {}
    file_meta: dict[str, dict] = {}
    for rel in files:
        if not source.exists(rel):
            raise FormatError(f"{source.label(rel)}: shard listed in {INDEX_NAME} is missing")
        header, data_start = read_header(source, rel)
        index.files[rel] = source.size(rel)
        meta = header.get("__metadata__", {})
        file_meta[rel] = meta
        if ALIASES_KEY in meta:
            aliases.update(_json_field(meta, ALIASES_KEY, source.label(rel)))
        if OBJECTS_KEY in meta:
            role = {"role": "optimizer"} if rel.startswith("optimizer") else {}
            for key, value in _json_field(meta, OBJECTS_KEY, source.label(rel)).items():
                index.add_object(ObjectEntry(key, value, attrs=dict(role)))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in index.tensors:
                raise FormatError(f"{source.label(rel)}: tensor {name} also appears in "
                                  f"{index.tensors[name].pieces[0].location.file}")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            attrs = {"role": "optimizer"} if rel.startswith("optimizer") else {}
            index.add_tensor(TensorEntry(name, from_safetensors(info["dtype"]), shape,
                                         [Piece(Box.whole(shape), Location(rel, data_start + begin, end - begin))],
                                         attrs=attrs))
    if weight_map is not None:
        for name, rel in weight_map.items():
            if name not in index.tensors and name not in aliases:
                raise FormatError(f"{source.label(INDEX_NAME)}: tensor {name} is mapped to {rel}, "
                                  f"which does not contain it")
    for alias, target in aliases.items():
        if target not in index.tensors:
            raise FormatError(f"{source.label('')}: alias {alias} points at missing tensor {target}")
        t = index.tensors[target]
        index.add_tensor(TensorEntry(alias, t.dtype, t.shape, list(t.pieces), attrs={"alias_of": target}))
    index.metadata["safetensors_metadata"] = file_meta
    index.world_size = None
    return index


def _json_field(meta: dict, key: str, label: str) -> dict:
    value = json_loads(meta[key], label, f"__metadata__[{key!r}]")
    if not isinstance(value, dict):
        raise FormatError(f"{label}: __metadata__[{key!r}] must be a JSON object")
    return value
