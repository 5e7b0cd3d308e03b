"""JSON for the canonical index (`inspect --json`), with a schema version.

Objects are written as a safe, JSON-only representation of their value; reading the JSON back
gives an index whose objects hold that representation, so JSON -> index -> JSON is stable.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import FormatError, quote
from ..lazy_torch import is_instance, is_tensor
from ..safeload import Inert
from ..torch_types import DType, Size, SmallTensor
from .types import Box, CheckpointIndex, Encoding, FlatRange, IntegrityCheck, Location, ObjectEntry, Piece, TensorEntry

SCHEMA = "ckptkit.index/1"


VALUE_CHARS = 1 << 24  # what one value may write to JSON: shared parts are written each time they are reached


def safe_value(value: Any, depth: int = 0, left: list[int] | None = None) -> Any:
    """A JSON-friendly description of any value the restricted unpickler can produce (and of
    torch's own objects, for values built in memory). A value is cut where it would write more
    than VALUE_CHARS (a pickle can reference one long string thousands of times): what was not
    written is {"__cut__": <what it is>}, and text beyond the rest {"__text__": head, "__chars__": n}."""
    if left is None:
        left = [VALUE_CHARS]
    left[0] -= 1
    if left[0] < 0:
        return {"__cut__": type(value).__name__}
    if depth > 32:
        return {"__repr__": "<nested too deeply>"}
    if isinstance(value, str):
        if len(value) > left[0]:
            head, left[0] = value[: max(0, left[0])], 0
            return {"__text__": head, "__chars__": len(value)}
        left[0] -= len(value)
        return value
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, dict):
        return {str(k): safe_value(v, depth + 1, left) for k, v in value.items()}
    if isinstance(value, Size) or is_instance(value, "Size"):
        return list(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return [
            safe_value(v, depth + 1, left)
            for v in (sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value)
        ]
    if isinstance(value, SmallTensor):
        out: dict[str, Any] = {"__tensor__": {"dtype": value.dtype, "shape": list(value.shape)}}
        values = value.tolist() if value.numel <= 16 else None
        if values is not None:
            out["__tensor__"]["values"] = values
        return out
    if is_tensor(value):
        out = {"__tensor__": {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}}
        if value.numel() <= 16:
            out["__tensor__"]["values"] = (
                value.detach().float().reshape(-1).tolist()
                if value.dtype.is_floating_point
                else value.reshape(-1).tolist()
            )
        return out
    if isinstance(value, Inert):
        return safe_value(value.to_data(), depth + 1, left)
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": len(value)}
    if isinstance(value, DType):
        return {"__dtype__": value.name}
    if is_instance(value, "dtype"):
        return {"__dtype__": str(value).removeprefix("torch.")}
    return {"__repr__": repr(value)[:200]}


def _region_to_json(region: Box | FlatRange) -> dict:
    if isinstance(region, Box):
        return {"box": {"offsets": list(region.offsets), "sizes": list(region.sizes)}}
    return {"flat": {"start": region.start, "length": region.length}}


def _region_from_json(doc: dict) -> Box | FlatRange:
    if "box" in doc:
        return Box(tuple(doc["box"]["offsets"]), tuple(doc["box"]["sizes"]))
    return FlatRange(doc["flat"]["start"], doc["flat"]["length"])


def _location_to_json(loc: Location) -> dict:
    out: dict[str, Any] = {"file": loc.file, "offset": loc.offset, "length": loc.length, "encoding": loc.encoding}
    if loc.stride is not None:
        out["stride"] = list(loc.stride)
    if loc.transforms:
        out["transforms"] = list(loc.transforms)
    return out


def _location_from_json(doc: dict) -> Location:
    return Location(
        doc["file"],
        doc["offset"],
        doc["length"],
        doc.get("encoding", Encoding.RAW),
        tuple(doc["stride"]) if doc.get("stride") is not None else None,
        tuple(doc.get("transforms", ())),
    )


def _path_json(path: tuple | None) -> list | None:
    return list(path) if path is not None else None


def to_json(index: CheckpointIndex) -> dict:
    return {
        "schema": SCHEMA,
        "format": index.format,
        "root": index.root,
        "world_size": index.world_size,
        "step": index.step,
        "files": dict(index.files),
        "metadata": safe_value(index.metadata),
        "tensors": [
            {
                "key": t.key,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "path": _path_json(t.path),
                "attrs": safe_value(t.attrs),
                "pieces": [{**_region_to_json(p.region), "location": _location_to_json(p.location)} for p in t.pieces],
            }
            for t in index.tensors.values()
        ],
        "objects": [
            {
                "key": o.key,
                "path": _path_json(o.path),
                "value": safe_value(o.data),
                "location": _location_to_json(o.location) if o.location else None,
                "attrs": safe_value(o.attrs),
            }
            for o in index.objects.values()
        ],
        "checks": [
            {"file": c.file, "offset": c.offset, "length": c.length, "crc32": c.crc32, "what": c.what}
            for c in index.checks
        ],
    }


def from_json(doc: dict) -> CheckpointIndex:
    if doc.get("schema") != SCHEMA:
        raise FormatError(f"index JSON has schema {quote(str(doc.get('schema')))}, expected {SCHEMA!r}")
    index = CheckpointIndex(
        format=doc["format"],
        root=doc["root"],
        world_size=doc.get("world_size"),
        step=doc.get("step"),
        files=dict(doc.get("files", {})),
        metadata=doc.get("metadata", {}),
    )
    for t in doc["tensors"]:
        index.add_tensor(
            TensorEntry(
                t["key"],
                t["dtype"],
                tuple(t["shape"]),
                [Piece(_region_from_json(p), _location_from_json(p["location"])) for p in t["pieces"]],
                path=tuple(t["path"]) if t.get("path") is not None else None,
                attrs=t.get("attrs", {}),
            )
        )
    for o in doc["objects"]:
        index.add_object(
            ObjectEntry(
                o["key"],
                o["value"],
                path=tuple(o["path"]) if o.get("path") is not None else None,
                location=_location_from_json(o["location"]) if o.get("location") else None,
                attrs=o.get("attrs", {}),
            )
        )
    index.checks = [
        IntegrityCheck(c["file"], c["offset"], c["length"], c["crc32"], c["what"]) for c in doc.get("checks", [])
    ]
    return index
