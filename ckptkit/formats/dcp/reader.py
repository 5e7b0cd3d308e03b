"""Index a torch.distributed.checkpoint folder without torch.load or plain pickle.

`.metadata` (or the rank-local `__{rank}.metadata` files) is unpickled by the restricted loader
into inert stand-ins; each tensor chunk is a torch.save archive inside a `.distcp` file, whose zip
directory we parse to find the exact bytes of the chunk. Bytes items (non-tensor values) are
loaded through the restricted loader as objects, keeping their location for verbatim copies.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ...errors import CkptkitError, FormatError, name_of, quote
from ...index import mesh, problems
from ...index.dtypes import dtype_name, itemsize
from ...index.types import (
    Box,
    CheckpointIndex,
    Encoding,
    IntegrityCheck,
    Location,
    ObjectEntry,
    Piece,
    TensorEntry,
    unchecked_box,
)
from ...runner import codecs
from ...safeload import Inert, TensorRef, restricted_loads_dcp_metadata
from ...torch_types import DType, Size
from ...storage.source import LocalSource, Source
from ...runner.torch_archive import (
    SMALL_ARCHIVE,
    StructureMemo,
    load_bytes_archive,
    load_structure,
    open_archive,
    tensor_location,
)

# (the item template reuses the layout memo's skeleton and its way of making NamedTuples)
from .conflicts import refuse_twin, same_entry
from .item_templates import ItemFiles, ItemTemplates, MatchedChecks, ReadWindow, safe_relpath

FORMAT = "dcp"
METADATA = ".metadata"
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def metadata_files(source: Source) -> list[str]:
    names = source.listdir("")
    if METADATA in names:
        if source.isdir(METADATA):
            raise FormatError(f"{source.label(METADATA)}: is a folder, expected DCP's metadata file")
        return [METADATA]
    ranked = sorted((int(m.group(1)), n) for n in names if (m := _RANK_METADATA.match(n)))
    return [n for _, n in ranked if not source.isdir(n)]


def detect(source: Source) -> bool:
    return source.isdir("") and bool(metadata_files(source))


def _field(obj: Any, name: str, what: str, label: str, default: Any = ...) -> Any:
    if isinstance(obj, Inert) or hasattr(obj, "__dict__"):
        if name in obj.__dict__:
            return obj.__dict__[name]
    if default is not ...:
        return default
    raise FormatError(f"{label}: {what} has no field {name!r} (not DCP metadata?)")


def _props_dtype(props: Any, label: str, key: str) -> DType:
    dtype = props.__dict__.get("dtype") if hasattr(props, "__dict__") else None
    if dtype is None:
        state = getattr(props, "__dict__", {}).get("_state")
        if isinstance(state, tuple) and state:
            dtype = state[0]
    if not isinstance(dtype, DType):
        raise FormatError(f"{label}: tensor {key} has no dtype in its properties")
    return dtype


_PLAIN_INT = {int}


def _ints(value: Any, what: str, label: str) -> tuple[int, ...]:
    """A tuple of non-negative ints (torch.Size, list or tuple), or a clear error."""
    if isinstance(value, (tuple, list)) and value and set(map(type, value)) == _PLAIN_INT and min(value) >= 0:
        return tuple(value)  # (the common case, without a generator per element: 100k tensors have 300k)
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    ):
        raise FormatError(f"{label}: {what} must be a list of non-negative integers, found {value!r:.80}")
    return tuple(int(x) for x in value)


def _count(value: Any, what: str, label: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FormatError(f"{label}: {what} must be a non-negative integer, found {value!r:.80}")
    return value


def _mapping(value: Any, what: str, label: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FormatError(f"{label}: {what} must be a mapping, found {type(value).__name__}")
    return value


def _load_metadata(source: Source, name: str) -> Any:
    label = source.label(name)
    md = restricted_loads_dcp_metadata(source.read(name, 0, source.size(name)), label)
    if type(md).__name__ != "Metadata" or not isinstance(getattr(md, "__dict__", {}).get("state_dict_metadata"), dict):
        raise FormatError(f"{label}: not a DCP Metadata object (found {type(md).__name__})")
    return md


def read_index(source: Source, parallel: int = 8) -> CheckpointIndex:
    names = metadata_files(source)
    if not names:
        raise FormatError(f"{source.label('')}: no .metadata file (incomplete or not a DCP checkpoint)")
    merged = _Merged()
    for name in names:
        merged.add(_load_metadata(source, name), source.label(name))
    index = _new_index(source, names, merged)
    jobs = _item_jobs(index, merged, source.label(names[0]))
    del merged  # (the metadata's objects the jobs do not hold go before the items' are made: peak RSS)
    _add_items(index, source, jobs, _read_items(source, jobs, parallel))
    ranks = [int(m.group(1)) for n in index.files if (m := _DATA_FILE.match(n))]
    index.world_size = max(ranks) + 1 if ranks else None
    try:
        mesh.annotate(index)  # saved on a 2-D mesh (HSDP, FSDP2 + TP): sizes and tp splits for inspect
    except CkptkitError:  # a damaged folder (verify goes on reading it) is just not annotated
        pass
    return index


def state_dict_order(source: Source) -> list[str]:
    """The flat keys in the saved state dict's order: `planner_data`'s order, which is rank 0's
    flattening (`.metadata`'s own key order is already shuffled by the dedup of replicated items)."""
    merged = _Merged()
    for name in metadata_files(source):
        merged.add(_load_metadata(source, name), source.label(name))
    return list(merged.planner) + [k for k in merged.sd_meta if k not in merged.planner]


# the most items per task of the reading threads (a small item costs tens of microseconds)
_BATCH = 256
# a storage record's key: the item's fqn and, for a tensor chunk, its offsets
_StorageKey = tuple[str, tuple[int, ...] | None]
# one item to read: the entry it fills, its box (None for a value) and its storage record
_Job = tuple[Any, Box | None, Any]


@dataclass
class _Merged:
    """What every metadata file of the checkpoint says, merged (the first file wins a key)."""

    sd_meta: dict[str, Any] = field(default_factory=dict)
    chunks: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], None]] = field(default_factory=dict)  # ordered sets
    storage: dict[_StorageKey, Any] = field(default_factory=dict)
    planner: dict[str, Any] = field(default_factory=dict)
    versions: set = field(default_factory=set)
    save_id: Any = None

    def add(self, md: Any, label: str) -> None:
        self.versions.add(_field(md, "version", "Metadata", label, None))
        sm = _field(md, "storage_meta", "Metadata", label, None)
        if sm is not None:
            self.save_id = getattr(sm, "__dict__", {}).get("save_id", self.save_id)
        setdefault = self.sd_meta.setdefault
        for key, meta in _field(md, "state_dict_metadata", "Metadata", label).items():
            if type(key) is not str:
                raise FormatError(f"{label}: state_dict_metadata has a non-string key {key!r:.60}")
            first = setdefault(key, meta)
            if first is not meta:  # (rank-local metadata: every rank's file describes what it saved)
                same_entry(_described(first, key, label), _described(meta, key, label), key, label)
            if type(meta).__name__ == "TensorStorageMetadata":
                self._add_chunks(key, meta, label)
        # this file's records; a second file's (rank-local metadata) are merged after, the first record
        # of a key kept: every rank's file lists the values it saved alike
        mine: dict[_StorageKey, Any] = {} if self.storage else self.storage
        keep = mine.setdefault
        records = _mapping(_field(md, "storage_data", "Metadata", label, None), "storage_data", label)
        for mi, info in records.items():
            fields = getattr(mi, "__dict__", None)
            off = fields.get("offset", _NO_FIELD) if fields is not None and "fqn" in fields else _NO_FIELD
            where = _sized(off) if off is not None else None
            if off is None or where is not None:  # torch's own kind: no checks due
                fqn = fields["fqn"]
            else:
                fqn = _field(mi, "fqn", "MetadataIndex", label)
                off = _field(mi, "offset", "MetadataIndex", label, None)
                if type(off) is list:  # torch hashes a MetadataIndex: a list offset fails its dict
                    raise FormatError(
                        f"{label}: the storage record of {name_of(fqn)} has a list as its offset; "
                        f"torch.load cannot read such a .metadata"
                    )
                where = _ints(off, f"storage record offset of {fqn}", label) if off is not None else None
            if keep((fqn, where), info) is not info:
                refuse_twin(label, fqn, where)
        if mine is not self.storage:
            for key, info in mine.items():
                self.storage.setdefault(key, info)
        planner = self.planner
        for key, path in _mapping(_field(md, "planner_data", "Metadata", label, None), "planner_data", label).items():
            if isinstance(path, (tuple, list)) and (
                set(map(type, path)) <= _STR_OR_INT  # (no generator a key)
                or all(isinstance(p, (str, int)) for p in path)
            ):
                if ".".join(map(str, path)) != key:  # torch names each entry by its path joined with dots
                    raise FormatError(
                        f"{label}: planner_data gives {quote(str(key))} the path "
                        f"{quote(str(tuple(path)))}, which does not join to that name (torch's "
                        f"load would rebuild the state dict otherwise or fail)"
                    )
                planner[key] = tuple(path)

    def _add_chunks(self, key: str, meta: Any, label: str) -> None:
        """The chunk boxes of tensor `key`, each once, checked against the tensor's rank."""
        seen = self.chunks.setdefault(key, {})  # an ordered set: a tensor may have thousands of chunks
        boxes = _plain_boxes(meta)
        if boxes is not None:
            for box in boxes:
                seen.setdefault(box, None)
            return
        rank = len(_ints(_field(meta, "size", f"tensor {key}", label), f"tensor {key} size", label))
        chunk_list = _field(meta, "chunks", f"tensor {key}", label)
        if not isinstance(chunk_list, (list, tuple)):
            raise FormatError(f"{label}: tensor {key} chunks must be a list, found {type(chunk_list).__name__}")
        for ch in chunk_list:
            box = (
                _ints(_field(ch, "offsets", "chunk", label), f"tensor {key} chunk offsets", label),
                _ints(_field(ch, "sizes", "chunk", label), f"tensor {key} chunk sizes", label),
            )
            if len(box[0]) != rank or len(box[1]) != rank:
                raise FormatError(
                    f"{label}: tensor {key} has a chunk of rank {len(box[1])} "
                    f"(offsets {list(box[0])}), the tensor has rank {rank}"
                )
            seen.setdefault(box, None)


def _described(meta: Any, key: str, label: str) -> tuple:
    """What same_entry compares: a tensor's dtype and shape, or a value's kind."""
    if type(meta).__name__ != "TensorStorageMetadata":
        return (type(meta).__name__,)
    size = _ints(_field(meta, "size", f"tensor {key}", label), f"tensor {key} size", label)
    return "tensor", size, _props_dtype(_field(meta, "properties", f"tensor {key}", label), label, key)


_NO_FIELD = object()
_STR_OR_INT = {str, int}


def _sized(value: Any) -> tuple[int, ...] | None:
    """`value` as a tuple when it is the kind torch pickles (a torch.Size, whose items the unpickler
    made ints, none negative), else None: the checked path (`_ints`) reads it and words what is wrong."""
    if type(value) is Size and (not value or min(value) >= 0):
        return tuple(value)
    return None


def _plain_boxes(meta: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """The chunk boxes of a tensor's metadata when it is the kind torch pickles (torch.Size of
    non-negative ints, of the tensor's rank, in a list of chunk objects), without a check per
    field; None for anything else, which the checked path reads (and words what is wrong)."""
    fields = meta.__dict__
    size, chunks = _sized(fields.get("size")), fields.get("chunks")
    if size is None or type(chunks) is not list:
        return None
    rank = len(size)
    boxes = []
    for chunk in chunks:
        got = getattr(chunk, "__dict__", None)
        if got is None:
            return None
        offsets, sizes = got.get("offsets"), got.get("sizes")  # (_sized inline: 200k chunks' worth of calls)
        if (
            type(offsets) is not Size
            or type(sizes) is not Size
            or len(offsets) != rank
            or len(sizes) != rank
            or (rank and (min(offsets) < 0 or min(sizes) < 0))
        ):
            return None
        boxes.append((tuple(offsets), tuple(sizes)))
    return boxes


def _new_index(source: Source, names: list[str], merged: _Merged) -> CheckpointIndex:
    """The index before its entries: versions, metadata files, save id, the files and their sizes."""
    index = CheckpointIndex(format=FORMAT, root=source.root)
    index.metadata["dcp_version"] = sorted(v for v in merged.versions if v) or None
    index.metadata["metadata_files"] = names
    if merged.save_id:
        index.metadata["save_id"] = merged.save_id
    for name in source.listdir(""):
        if _DATA_FILE.match(name) or name in names:
            index.files[name] = source.size(name)
    return index


def _item_jobs(index: CheckpointIndex, merged: _Merged, label: str) -> list[_Job]:
    """One job per tensor chunk and per value, each with its storage record; tensors are added to
    `index` now (their pieces come from the jobs), values when read."""
    jobs: list[_Job] = []
    names: dict[DType, str] = {}
    storage = merged.storage
    # one tuple per distinct chunk offsets or sizes (a model repeats a few: 48 B a piece each). Not
    # the entries' shapes: a writer pickles those (param_shapes), and a pickle writes a shared
    # tuple as a reference to its first copy, so sharing them would change the output's bytes
    shared = {}.setdefault
    for key, meta in merged.sd_meta.items():
        path = merged.planner.get(key)
        kind = type(meta).__name__
        if kind == "TensorStorageMetadata":
            fields = meta.__dict__
            props = getattr(fields.get("properties"), "__dict__", None)  # torch's kind: the dtype first in
            state = props.get("_state") if props is not None and "dtype" not in props else None  # its state
            dtype = state[0] if type(state) is tuple and state else None
            if type(dtype) is not DType:  # any other: the checked path, which says what is wrong
                dtype = _props_dtype(_field(meta, "properties", f"tensor {key}", label), label, key)
            shape = _sized(fields.get("size"))
            if shape is None:
                shape = _ints(_field(meta, "size", f"tensor {key}", label), f"tensor {key} size", label)
            name = names.get(dtype)
            if name is None:
                name = names[dtype] = dtype_name(dtype)
            entry = TensorEntry(key, name, shape, [], path=path)
            index.add_tensor(entry)
            for offsets, sizes in merged.chunks[key]:
                info = storage.get((key, offsets))
                if info is None:
                    raise FormatError(f"{label}: tensor {key} chunk at offsets {list(offsets)} has no storage record")
                box = unchecked_box(shared(offsets, offsets), shared(sizes, sizes))  # (ranks checked by _Merged.add)
                jobs.append((entry, box, info))
        elif kind == "BytesStorageMetadata":
            info = merged.storage.get((key, None))
            if info is None:
                raise FormatError(f"{label}: value {key} has no storage record")
            jobs.append((ObjectEntry(key, None, path=path), None, info))
        else:
            raise FormatError(f"{label}: key {key} has unknown storage metadata {kind}")
    return jobs


def _read_items(source: Source, jobs: list[_Job], parallel: int) -> list[Any]:
    """Each job's (piece or value, checks), or the CkptkitError that stopped it: handed back, so
    that verify lists it and goes on (index.problems).

    The small items of a local folder are read in one thread: they are CPU work under the GIL,
    which threads only contend for; threads serve remote sources and large items, whose reads wait."""
    memo = StructureMemo()  # same-shaped items share their data.pkl and zip layout: checked once
    files = ItemFiles(source)
    templates = ItemTemplates(files)  # a run of items laid out alike: one comparison each

    def run(batch: list[_Job]) -> list[Any]:
        results: list[Any] = []
        window = ReadWindow(source)
        fast = templates.item
        for job in batch:
            try:
                got = fast(*job, window)
                results.append(
                    got
                    if got is not None
                    else _read_item(source, *job, memo=memo, files=files, window=window, learn=templates)
                )
            except CkptkitError as exc:
                results.append(exc)
        return results

    if parallel > 1 and len(jobs) > 8 and not (isinstance(source, LocalSource) and _mostly_small(jobs)):
        size = min(_BATCH, -(-len(jobs) // (parallel * 4)))  # a few batches per thread, however few items
        batches = [jobs[i : i + size] for i in range(0, len(jobs), size)]  # a future per item costs too much
        with ThreadPoolExecutor(parallel) as pool:
            return [result for batch in pool.map(run, batches) for result in batch]
    return run(jobs)


def _mostly_small(jobs: list[_Job]) -> bool:
    """Nine items in ten or more are small archives (read whole, then parsed: CPU work only)."""
    small = sum(
        1
        for _, _, info in jobs
        if isinstance(length := getattr(info, "__dict__", {}).get("length"), int) and length <= SMALL_ARCHIVE
    )
    return small * 10 >= len(jobs) * 9


def _add_items(index: CheckpointIndex, source: Source, jobs: list[_Job], results: list[Any]) -> None:
    """Pieces to their tensors, values to the index, checks to the index's checks; an item that
    could not be read is raised unless problems are being collected."""
    table = index.checks
    pending: list[IntegrityCheck] = []  # the full path's checks, added at once (a call an item costs)
    for (target, _, info), result in zip(jobs, results):
        if isinstance(result, CkptkitError):
            if not problems.tolerate(result, _item_file(source, info), target.key):
                raise result
            continue
        piece_or_value, checks = result
        if isinstance(target, TensorEntry):
            target.pieces.append(piece_or_value)
        else:
            target.data, target.location = piece_or_value
            index.add_object(target)
        if type(checks) is MatchedChecks:
            if pending:
                table.extend(pending)
                pending = []
            checks.add_to(table)
        else:
            pending += checks
    table.extend(pending)


def _item_file(source: Source, info: Any) -> str:
    """The path of the data file a storage record names (the folder when it names none usable)."""
    path = getattr(info, "__dict__", {}).get("relative_path")
    try:
        return source.label(safe_relpath(path, source.label("")))
    except CkptkitError:
        return source.label("")


def _read_item(
    source: Source,
    target: Any,
    box: Box | None,
    info: Any,
    memo: StructureMemo | None = None,
    files: ItemFiles | None = None,
    window: ReadWindow | None = None,
    learn: ItemTemplates | None = None,
):
    files = files if files is not None else ItemFiles(source)
    label = files.label
    what = f"storage record of {target.key}"
    rel = files.relpath(_field(info, "relative_path", "_StorageInfo", label), what)
    offset = _count(_field(info, "offset", "_StorageInfo", label), f"{what}: offset", label)
    length = _count(_field(info, "length", "_StorageInfo", label), f"{what}: length", label)
    transforms = _field(info, "transform_descriptors", "_StorageInfo", label, None) or ()
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise FormatError(f"{label}: {what}: transform_descriptors must be a list of strings")
    transforms = tuple(transforms)
    if transforms:
        codecs.check(transforms, f"{source.label(rel)} ({what})")
    size = files.size(rel, what)
    if offset < 0 or length < 0 or offset + length > size:
        raise FormatError(
            f"{source.label(rel)}: item of {target.key} at bytes {offset}..{offset + length} "
            f"lies past the end of the file ({size} bytes; truncated?)"
        )
    if isinstance(target, TensorEntry):
        if transforms:  # decoded (within bounds) when read; a size no frame can reach is refused now
            codecs.check_declared(
                transforms, length, box.numel * itemsize(target.dtype), f"{source.label(rel)} (item of {target.key})"
            )
            return Piece(box, Location(rel, offset, length, Encoding.TORCH_SAVE, transforms=transforms)), []
        data = window.read(rel, offset, length, size) if window is not None and 22 <= length <= SMALL_ARCHIVE else None
        archive = open_archive(source, rel, offset, length, memo=memo, data=data)
        ref = load_structure(archive, eager=False, memo=memo)
        if not isinstance(ref, TensorRef):
            raise FormatError(f"{source.label(rel)}: item of {target.key} does not hold a tensor")
        dtype, loc = tensor_location(archive, ref, target.key, memo=memo)
        if dtype != target.dtype or tuple(ref.size) != box.sizes:
            raise FormatError(
                f"{source.label(rel)}: item of {target.key} holds {dtype} {list(ref.size)}, "
                f"metadata says {target.dtype} {list(box.sizes)}"
            )
        checks = archive.checks()
        if learn is not None and data is not None:
            learn.learn(archive, dtype, tuple(ref.size), loc, checks)
        return Piece(box, loc), checks
    raw = source.read(rel, offset, length)
    data = codecs.decode(raw, transforms, f"{source.label(rel)} (value {target.key})")
    if data[:4] == b"PK\x03\x04":
        value = load_bytes_archive(data, f"{source.label(rel)} (value {target.key})")
        encoding = Encoding.TORCH_SAVE
    else:
        value = data  # a raw io.BytesIO value saved as is
        encoding = Encoding.BYTES
    return (value, Location(rel, offset, length, encoding, transforms=transforms)), []
