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
    header = json_loads(source.read(rel, 8, n), label, "header", unique_keys=True)
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
        if (
            not isinstance(shape, list)
            or not all(type(d) is int and 0 <= d < _U64 for d in shape)
            or not isinstance(offs, list)
            or len(offs) != 2
            or not all(type(o) is int for o in offs)
        ):  # (not bool: JSON's true is no dimension)
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
            raise FormatError(
                f"{label}: tensor {name_of(name)} data_offsets {offs} lie outside the {buffer}-byte data buffer"
            )
        if end - begin != expected:
            raise FormatError(
                f"{label}: tensor {name_of(name)} is {dtype}{shape} ({expected} bytes) but its "
                f"data_offsets span {end - begin} bytes"
            )
        spans.append((begin, end, name))
    _check_tiling(label, spans, buffer)
    return header, 8 + n


def _check_tiling(label: str, spans: list[tuple[int, int, str]], buffer: int) -> None:
    """The tensors tile the data buffer exactly, in the order of their offsets, as the safetensors
    library requires (its Metadata::validate): no overlap, no gap, no byte after the last."""
    spans.sort()
    reach, holder = 0, None  # the furthest end so far, and whose (an empty tensor between cannot hide it)
    for begin, end, name in spans:
        if begin < reach:
            raise FormatError(f"{label}: tensors {name_of(holder)} and {name_of(name)} overlap in the data buffer")
        if begin > reach:
            raise FormatError(
                f"{label}: tensor {name_of(name)} starts at byte {begin} of the data buffer, after "
                f"{begin - reach} bytes no tensor holds; the safetensors library refuses such a file"
            )
        if end > begin:
            reach, holder = end, name
    if reach != buffer:
        raise FormatError(
            f"{label}: the data buffer holds {buffer - reach} bytes after its last tensor; the "
            f"safetensors library refuses such a file"
        )


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
            _merge_aliases(aliases, _json_field(meta, ALIASES_KEY, source.label(rel)), source.label(rel))
        if OBJECTS_KEY in meta:
            role = {"role": "optimizer"} if rel.startswith("optimizer") else {}
            for key, value in _json_field(meta, OBJECTS_KEY, source.label(rel)).items():
                old = index.objects.get(key)
                if old is not None and old.data != value:
                    raise FormatError(
                        f"{source.label(rel)}: __metadata__[{OBJECTS_KEY!r}] gives value "
                        f"{name_of(key)} otherwise than another shard does"
                    )
                index.add_object(ObjectEntry(key, value, attrs=dict(role)))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in index.tensors:
                raise FormatError(
                    f"{source.label(rel)}: tensor {name} also appears in {index.tensors[name].pieces[0].location.file}"
                )
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            attrs = {"role": "optimizer"} if rel.startswith("optimizer") else {}
            index.add_tensor(
                TensorEntry(
                    name,
                    from_safetensors(info["dtype"]),
                    shape,
                    [Piece(Box.whole(shape), Location(rel, data_start + begin, end - begin))],
                    attrs=attrs,
                )
            )
    if weight_map is not None:
        for name, rel in weight_map.items():
            held = index.tensors.get(name)
            if (held is None or held.pieces[0].location.file != rel) and name not in aliases:
                raise FormatError(
                    f"{source.label(INDEX_NAME)}: tensor {name_of(name)} is mapped to {name_of(rel)}, "
                    f"which does not contain it"
                )
    for key in index.objects:
        if key in index.tensors:
            raise FormatError(
                f"{source.label('')}: __metadata__[{OBJECTS_KEY!r}] gives a value named {name_of(key)}, "
                f"but the files hold a tensor of that name"
            )
    _add_aliases(index, aliases, source.label(""))
    index.metadata["safetensors_metadata"] = file_meta
    index.world_size = None
    return index


def _merge_aliases(aliases: dict[str, str], found: dict, label: str) -> None:
    """Add one shard's alias map (every shard ckptkit writes carries the whole map): an alias
    given another target by another shard is a conflict, never resolved by picking one."""
    for alias, target in found.items():
        if type(target) is not str:
            raise FormatError(
                f"{label}: __metadata__[{ALIASES_KEY!r}] gives alias {name_of(alias)} a target that is no tensor name"
            )
        if aliases.setdefault(alias, target) != target:
            raise FormatError(
                f"{label}: __metadata__[{ALIASES_KEY!r}] makes {name_of(alias)} an alias of "
                f"{name_of(target)}, another shard of {name_of(aliases[alias])}"
            )


def _add_aliases(index: CheckpointIndex, aliases: dict[str, str], label: str) -> None:
    """The tied tensors ckptkit's writer stored once: each alias a name the files do not hold
    (an alias never replaces a tensor or value the file really holds), sharing a stored tensor."""
    for alias in aliases:
        if alias in index.tensors or alias in index.objects:
            kind = "tensor" if alias in index.tensors else "value"
            raise FormatError(
                f"{label}: __metadata__[{ALIASES_KEY!r}] names {name_of(alias)} an alias, but "
                f"the files hold a {kind} of that name; an alias never replaces what a file holds"
            )
    for alias, target in aliases.items():
        if target in aliases:
            raise FormatError(
                f"{label}: alias {name_of(alias)} points at another alias, {name_of(target)}; "
                f"ckptkit writes aliases of stored tensors only"
            )
        t = index.tensors.get(target)
        if t is None:
            raise FormatError(f"{label}: alias {name_of(alias)} points at missing tensor {name_of(target)}")
        index.add_tensor(TensorEntry(alias, t.dtype, t.shape, list(t.pieces), attrs={"alias_of": target}))


def _json_field(meta: dict, key: str, label: str) -> dict:
    value = json_loads(meta[key], label, f"__metadata__[{key!r}]", unique_keys=True)
    if not isinstance(value, dict):
        raise FormatError(f"{label}: __metadata__[{key!r}] must be a JSON object")
    return value
