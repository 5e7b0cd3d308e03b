"""The oracle's operators on DCP checkpoints: entries of `.metadata`, unpickled with torch's own
classes (the fixture is ours, so trusted), altered and pickled again: storage records (their
MetadataIndex, file, offset, length; doubled, swapped), chunks (offsets, sizes; dropped, doubled,
moved with their record), tensor sizes and dtypes, fqns doubled or renamed, planner_data paths.

A dict may be pickled with a key twice (DupDict: its pairs are written as they are), which no
Python dict can hold but a file can.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import random
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata


class DupDict(dict):
    """A dict pickled from `pairs`, repeated keys included."""

    def __init__(self, pairs: list) -> None:
        super().__init__(pairs)
        self.pairs = pairs


class _DupPickler(pickle._Pickler):
    dispatch = dict(pickle._Pickler.dispatch)

    def save_dup(self, obj: DupDict) -> None:
        self.write(pickle.EMPTY_DICT)
        self.memoize(obj)
        self._batch_setitems(iter(obj.pairs))

    dispatch[DupDict] = save_dup


def dumps(value) -> bytes:
    buf = io.BytesIO()
    _DupPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(value)
    return buf.getvalue()


def load_meta(folder: Path):
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # noqa: S301 - a fixture written by torch in this repository


def _records(meta) -> list:
    return list(meta.storage_data.items())


def _chunk_sizes(meta, key: MetadataIndex):
    entry = meta.state_dict_metadata.get(key.fqn)
    if not isinstance(entry, TensorStorageMetadata):
        return None
    return next((tuple(c.sizes) for c in entry.chunks if tuple(c.offsets) == tuple(key.offset or ())), None)


def _alike(meta, key) -> list:
    """Other records whose chunk has the same sizes as `key`'s (torch can load either into it)."""
    sizes = _chunk_sizes(meta, key)
    return [(k, v) for k, v in _records(meta) if k != key and sizes is not None and _chunk_sizes(meta, k) == sizes]


def record_hint_duplicate(rng: random.Random, meta):
    """Two records for one chunk that differ only in MetadataIndex.index (a hint torch never compares)."""
    candidates = [(k, v) for k, v in _records(meta) if _alike(meta, k)]
    if not candidates:
        return None
    key, value = rng.choice(candidates)
    other_key, other = rng.choice(_alike(meta, key))
    hint = MetadataIndex(key.fqn, key.offset, (key.index or 0) + rng.choice([1, 2, 7]))
    pairs = _records(meta)
    at = next(i for i, (k, _) in enumerate(pairs) if k == key)
    after = rng.random() < 0.5
    pairs.insert(at + after, (hint, other))
    meta.storage_data = DupDict(pairs)
    return (
        f"record {key.fqn}@{list(key.offset or ())} doubled with index {hint.index} "
        f"({'after' if after else 'before'} it), pointing at {other_key.fqn}'s bytes"
    )


def record_duplicate(rng: random.Random, meta):
    """One storage key written twice with another record's bytes."""
    candidates = [(k, v) for k, v in _records(meta) if _alike(meta, k)]
    if not candidates:
        return None
    key, _ = rng.choice(candidates)
    other_key, other = rng.choice(_alike(meta, key))
    pairs = _records(meta) + [(key, other)]
    meta.storage_data = DupDict(pairs)
    return f"record {key.fqn}@{list(key.offset or ())} written twice, the second pointing at {other_key.fqn}'s bytes"


def record_swap(rng: random.Random, meta):
    candidates = [(k, v) for k, v in _records(meta) if _alike(meta, k)]
    if not candidates:
        return None
    key, value = rng.choice(candidates)
    other_key, other = rng.choice(_alike(meta, key))
    meta.storage_data[key], meta.storage_data[other_key] = other, value
    here, there = list(key.offset or ()), list(other_key.offset or ())
    return f"records {key.fqn}@{here} and {other_key.fqn}@{there} swap their bytes"


def record_fields(rng: random.Random, meta):
    key, value = rng.choice(_records(meta))
    field = rng.choice(["offset", "length", "relative_path"])
    if field == "relative_path":
        files = sorted({v.relative_path for _, v in _records(meta)})
        new = rng.choice(files + ["missing.distcp", "../__0_0.distcp", ".metadata"])
    else:
        new = getattr(value, field) + rng.choice([-64, -8, -1, 1, 8, 64])
    meta.storage_data[key] = dataclasses.replace(value, **{field: new})
    return f"record {key.fqn}@{list(key.offset or ())}: {field} {getattr(value, field)!r} -> {new!r}"


def _tensor_entries(meta) -> list:
    return [(k, v) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]


def chunk(rng: random.Random, meta):
    """A chunk's offsets or sizes changed (its record left as it is), or a chunk dropped or doubled."""
    fqn, entry = rng.choice(_tensor_entries(meta))
    i = rng.randrange(len(entry.chunks))
    c = entry.chunks[i]
    kind = rng.choice(["offsets", "sizes", "drop", "double"])
    chunks = list(entry.chunks)
    if kind == "drop":
        del chunks[i]
    elif kind == "double":
        chunks.insert(i, c)
    else:
        vals = list(getattr(c, kind))
        if not vals:
            return None
        d = rng.randrange(len(vals))
        vals[d] = max(0, vals[d] + rng.choice([-1, 1, 2]))
        chunks[i] = dataclasses.replace(c, **{kind: torch.Size(vals)})
    entry.chunks = chunks
    return f"tensor {fqn}: chunk {i} ({list(c.offsets)}+{list(c.sizes)}): {kind}"


def chunk_move(rng: random.Random, meta):
    """A chunk and its record's key moved together to other offsets."""
    fqn, entry = rng.choice(_tensor_entries(meta))
    i = rng.randrange(len(entry.chunks))
    c = entry.chunks[i]
    if not len(c.offsets):
        return None
    vals = list(c.offsets)
    d = rng.randrange(len(vals))
    vals[d] += rng.choice([-1, 1])
    if vals[d] < 0:
        return None
    new_offsets = torch.Size(vals)
    entry.chunks = [dataclasses.replace(x, offsets=new_offsets) if j == i else x for j, x in enumerate(entry.chunks)]
    pairs = [
        (MetadataIndex(k.fqn, new_offsets, k.index) if k.fqn == fqn and tuple(k.offset) == tuple(c.offsets) else k, v)
        for k, v in _records(meta)
    ]
    meta.storage_data = dict(pairs)
    return f"tensor {fqn}: chunk {list(c.offsets)} and its record moved to {vals}"


def tensor_size(rng: random.Random, meta):
    fqn, entry = rng.choice(_tensor_entries(meta))
    vals = list(entry.size)
    new = vals[::-1] if rng.random() < 0.3 or not vals else [v + rng.choice([-1, 1]) for v in vals]
    entry.size = torch.Size([max(0, v) for v in new])
    return f"tensor {fqn}: size {vals} -> {list(entry.size)}"


def tensor_dtype(rng: random.Random, meta):
    fqn, entry = rng.choice(_tensor_entries(meta))
    new = rng.choice([torch.float16, torch.bfloat16, torch.int32, torch.float64, torch.uint8, torch.bool])
    old = entry.properties.dtype
    entry.properties = dataclasses.replace(entry.properties, dtype=new)
    return f"tensor {fqn}: properties.dtype {old} -> {new}"


def fqn_duplicate(rng: random.Random, meta):
    """One fqn twice in state_dict_metadata, the second entry another tensor's."""
    entries = list(meta.state_dict_metadata.items())
    (a, _), (b, eb) = rng.choice(entries), rng.choice(_tensor_entries(meta))
    entries.insert(rng.choice([0, len(entries)]), (a, copy.deepcopy(eb)))
    meta.state_dict_metadata = DupDict(entries)
    return f"state_dict_metadata names {a} twice, once with {b}'s entry"


def fqn_rename(rng: random.Random, meta):
    """An fqn renamed to another's: in state_dict_metadata only, or with its records and planner path."""
    names = list(meta.state_dict_metadata)
    a, b = rng.sample(names, 2)
    everywhere = rng.random() < 0.5
    meta.state_dict_metadata = DupDict([(b if k == a else k, v) for k, v in meta.state_dict_metadata.items()])
    if everywhere:
        meta.storage_data = DupDict(
            [(MetadataIndex(b, k.offset, k.index) if k.fqn == a else k, v) for k, v in _records(meta)]
        )
    return f"fqn {a} renamed {b} ({'with its records' if everywhere else 'in state_dict_metadata only'})"


def planner_path(rng: random.Random, meta):
    if not meta.planner_data:
        return None
    fqn = rng.choice(list(meta.planner_data))
    old = meta.planner_data[fqn]
    other = meta.planner_data[rng.choice(list(meta.planner_data))]
    new = rng.choice([other, old[:-1], old + ("x",), old[:-1] + (0,), ("model", fqn)])
    meta.planner_data[fqn] = new
    return f"planner_data[{fqn!r}]: {old} -> {new}"


OPERATORS = {
    "dcp-record-hint-duplicate": record_hint_duplicate,
    "dcp-record-duplicate": record_duplicate,
    "dcp-record-swap": record_swap,
    "dcp-record-fields": record_fields,
    "dcp-chunk": chunk,
    "dcp-chunk-move": chunk_move,
    "dcp-tensor-size": tensor_size,
    "dcp-tensor-dtype": tensor_dtype,
    "dcp-fqn-duplicate": fqn_duplicate,
    "dcp-fqn-rename": fqn_rename,
    "dcp-planner-path": planner_path,
}


def framework_load(path: Path) -> dict:
    """What dcp_to_torch_save loads (no process group), before it saves it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return state


def mutate(name: str, rng: random.Random, fixture: Path, out: Path):
    from helpers.oracle_verdict import Mutant

    meta = load_meta(fixture)
    what = OPERATORS[name](rng, meta)
    if what is None:
        return None
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for entry in os.listdir(fixture):
        if entry != ".metadata":
            os.link(fixture / entry, out / entry)
    (out / ".metadata").write_bytes(dumps(meta))
    return Mutant("dcp", name, f"{fixture.name}: {what}", out)
