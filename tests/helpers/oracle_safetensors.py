"""The oracle's operators on safetensors files: header JSON entries (dtype, shape, data_offsets),
names repeated in the JSON text, entry order, header length, and `__metadata__` entries, among
them ckptkit's own (`ckptkit.aliases`, `ckptkit.objects`).

The header is edited as a list of (name, entry) pairs and written back as JSON text, so a name may
appear twice; the data buffer is kept as it is.
"""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

from ckptkit.formats.safetensors.reader import ALIASES_KEY, OBJECTS_KEY

Pairs = list  # [(name, entry)]
SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
Result = "tuple[Pairs, bytes, str] | None"


def read(path: Path) -> tuple[Pairs, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return list(json.loads(raw[8 : 8 + n]).items()), raw[8 + n :]


def write(path: Path, pairs: Pairs, buffer: bytes, pad: int = 0, length_delta: int = 0) -> None:
    text = ("{" + ",".join(f"{json.dumps(k)}:{json.dumps(v, separators=(',', ':'))}" for k, v in pairs) + "}").encode()
    text += b" " * ((-len(text)) % 8 + pad)
    path.write_bytes(struct.pack("<Q", len(text) + length_delta) + text + buffer)


def _tensors(pairs: Pairs) -> list[int]:
    return [i for i, (k, _) in enumerate(pairs) if k != "__metadata__"]


def _metadata(pairs: Pairs) -> dict:
    return next((dict(v) for k, v in pairs if k == "__metadata__"), {})


def _set_metadata(pairs: Pairs, meta: dict) -> Pairs:
    rest = [(k, v) for k, v in pairs if k != "__metadata__"]
    return [("__metadata__", meta)] + rest


def _entry(pairs: Pairs, i: int, **changes) -> Pairs:
    out = list(pairs)
    out[i] = (pairs[i][0], {**pairs[i][1], **changes})
    return out


def dtype(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    """A tensor's dtype becomes another; its last dimension rescaled to keep its byte length where it divides."""
    i = rng.choice(_tensors(pairs))
    name, entry = pairs[i]
    new = rng.choice([d for d in SIZES if d != entry["dtype"]])
    shape = list(entry["shape"])
    old, size = SIZES[entry["dtype"]], SIZES[new]
    if shape and rng.random() < 0.8 and (shape[-1] * old) % size == 0:
        shape[-1] = shape[-1] * old // size
    return (
        _entry(pairs, i, dtype=new, shape=shape),
        buf,
        f"tensor {name!r}: dtype {entry['dtype']} -> {new}, shape {shape}",
    )


def shape(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    i = rng.choice(_tensors(pairs))
    name, entry = pairs[i]
    old = list(entry["shape"])
    kind = rng.choice(["reverse", "flatten", "split", "grow", "scalar"])
    if kind == "reverse":
        new = old[::-1]
    elif kind == "flatten":
        new = [math.prod(old)]
    elif kind == "split":
        new = old + [1] if rng.random() < 0.5 else [1] + old
    elif kind == "grow":
        new = [d + 1 for d in old] or [2]
    else:
        new = []
    return _entry(pairs, i, shape=new), buf, f"tensor {name!r}: shape {old} -> {new}"


def offsets(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    """Two tensors of one byte length swap data_offsets, or one tensor's span moves."""
    idx = _tensors(pairs)
    i = rng.choice(idx)
    name, entry = pairs[i]
    b, e = entry["data_offsets"]
    same = [j for j in idx if j != i and pairs[j][1]["data_offsets"][1] - pairs[j][1]["data_offsets"][0] == e - b]
    if same and rng.random() < 0.5:
        j = rng.choice(same)
        out = _entry(pairs, i, data_offsets=pairs[j][1]["data_offsets"])
        return _entry(out, j, data_offsets=[b, e]), buf, f"tensors {name!r} and {pairs[j][0]!r} swap data_offsets"
    d = rng.choice([-8, -4, -2, -1, 1, 2, 4, 8])
    return _entry(pairs, i, data_offsets=[b + d, e + d]), buf, f"tensor {name!r}: data_offsets shifted by {d}"


def duplicate_name(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    """One name twice in the header's JSON text: the second entry is another tensor's."""
    idx = _tensors(pairs)
    i, j = rng.choice(idx), rng.choice(idx)
    at = rng.choice([i, i + 1, len(pairs)])
    out = pairs[:at] + [(pairs[i][0], pairs[j][1])] + pairs[at:]
    return out, buf, f"tensor {pairs[i][0]!r} named twice, the extra entry (at {at}) with {pairs[j][0]!r}'s entry"


def alias_real_name(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    """ckptkit's alias record names a tensor the file really holds."""
    idx = _tensors(pairs)
    a, b = rng.sample(idx, 2)
    meta = _metadata(pairs)
    aliases = json.loads(meta.get(ALIASES_KEY, "{}"))
    aliases[pairs[a][0]] = pairs[b][0]
    meta[ALIASES_KEY] = json.dumps(aliases)
    return (
        _set_metadata(pairs, meta),
        buf,
        f"{ALIASES_KEY} names the held tensor {pairs[a][0]!r} an alias of {pairs[b][0]!r}",
    )


def alias(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    """ckptkit's alias record: a new name, a missing target, a cycle, itself, or no JSON object."""
    names = [pairs[i][0] for i in _tensors(pairs)]
    a, b = rng.sample(names, 2)
    value = rng.choice(
        [
            {"new.name": a},
            {"new.name": "missing"},
            {"x": "y", "y": "x"},
            {"x": "x"},
            {"x": a, "y": "x"},
            [a, b],
            "",
            {"x": 1},
            {"": a},
        ]
    )
    meta = _metadata(pairs)
    meta[ALIASES_KEY] = value if isinstance(value, str) else json.dumps(value)
    return _set_metadata(pairs, meta), buf, f"{ALIASES_KEY} = {meta[ALIASES_KEY]!r}"


def objects(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    """ckptkit's object record: a value under a tensor's name, or a plain one, or no JSON object."""
    names = [pairs[i][0] for i in _tensors(pairs)]
    value = rng.choice([{rng.choice(names): 1}, {"step": 3}, {rng.choice(names) + ".x": [1]}, [1], "{"])
    meta = _metadata(pairs)
    meta[OBJECTS_KEY] = json.dumps(value) if not isinstance(value, str) else value
    return _set_metadata(pairs, meta), buf, f"{OBJECTS_KEY} = {meta[OBJECTS_KEY]!r}"


def metadata(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    """__metadata__ itself: dropped, a non-string value, format tags, not an object, or twice."""
    kind = rng.choice(["drop", "number", "format", "list", "twice"])
    if kind == "drop":
        return [(k, v) for k, v in pairs if k != "__metadata__"], buf, "__metadata__ dropped"
    if kind == "number":
        return _set_metadata(pairs, {**_metadata(pairs), "n": 1}), buf, "__metadata__ holds a number"
    if kind == "format":
        tag = rng.choice(["np", "tf", "mlx", "flax", ""])
        return _set_metadata(pairs, {**_metadata(pairs), "format": tag}), buf, f"__metadata__ format {tag!r}"
    if kind == "list":
        rest = [(k, v) for k, v in pairs if k != "__metadata__"]
        return [("__metadata__", ["a"])] + rest, buf, "__metadata__ is a list"
    names = [pairs[i][0] for i in _tensors(pairs)]
    extra = {ALIASES_KEY: json.dumps({"extra.alias": rng.choice(names)})}
    return pairs + [("__metadata__", extra)], buf, "__metadata__ twice, the second with an alias"


def order(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    out = list(pairs)
    rng.shuffle(out)
    return out, buf, "header entries shuffled"


def header_length(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    """Trailing spaces in the header (which the format allows), or a header length off by some bytes."""
    return pairs, buf, rng.choice(["pad:8", "pad:3", "len:-1", "len:1", "len:8"])


def buffer_size(rng: random.Random, pairs: Pairs, buf: bytes) -> Result:
    d = rng.choice([-4, -1, 1, 4, 64])
    return pairs, (buf[:d] if d < 0 else buf + bytes(d)), f"data buffer {len(buf)} -> {len(buf) + d} bytes"


OPERATORS = {
    "st-dtype": dtype,
    "st-shape": shape,
    "st-offsets": offsets,
    "st-duplicate-name": duplicate_name,
    "st-alias-real-name": alias_real_name,
    "st-alias": alias,
    "st-objects": objects,
    "st-metadata": metadata,
    "st-order": order,
    "st-header-length": header_length,
    "st-buffer-size": buffer_size,
}


def framework_load(path: Path):
    from safetensors.torch import load_file

    return load_file(str(path))


def mutate(name: str, rng: random.Random, fixture: Path, out: Path):
    from helpers.oracle_verdict import Mutant

    pairs, buf = read(fixture)
    result = OPERATORS[name](rng, pairs, buf)
    if result is None:
        return None
    new, buf, what = result
    pad = delta = 0
    if what.startswith("pad:"):
        pad = int(what[4:])
    elif what.startswith("len:"):
        delta = int(what[4:])
    write(out, new, buf, pad, delta)
    return Mutant("safetensors", name, f"{fixture.name}: {what}", out)
