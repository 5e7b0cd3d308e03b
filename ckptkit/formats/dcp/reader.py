"""Index a torch.distributed.checkpoint folder without torch.load or plain pickle.

`.metadata` (or the rank-local `__{rank}.metadata` files) is unpickled by the restricted loader
into inert stand-ins; each tensor chunk is a torch.save archive inside a `.distcp` file, whose zip
directory we parse to find the exact bytes of the chunk. Bytes items (non-tensor values) are
loaded through the restricted loader as objects, keeping their location for verbatim copies.
"""

from __future__ import annotations

import os
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

from ...errors import CkptkitError, FormatError, name_of, quote
from ...index import mesh, problems
from ...index.dtypes import dtype_name, itemsize
from ...index.types import (
    Box,
    CheckpointIndex,
    CheckTable,
    Encoding,
    IntegrityCheck,
    Location,
    ObjectEntry,
    Piece,
    TensorEntry,
    unchecked_box,
    unchecked_location,
    unchecked_piece,
)
from ...runner import codecs
from ...safeload import Inert, TensorRef, restricted_loads_dcp_metadata
from ...torch_types import DType, Size
from ...storage.source import LocalSource, Source
from ...runner.torch_archive import (
    SMALL_ARCHIVE,
    Archive,
    StructureMemo,
    load_bytes_archive,
    load_structure,
    open_archive,
    tensor_location,
)

# (the item template reuses the layout memo's skeleton and its way of making NamedTuples)
from ...runner.structure_memo import ZipLayout
from ...runner.zip_directory import new_tuple, plain_directory
from ...runner.archive_records import ident_is_text, ident_name, record_names
from .conflicts import refuse_twin, same_entry

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


def _safe_relpath(path: Any, label: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise FormatError(f"{label}: storage record has a relative_path of type {type(path).__name__}")
    path = str(path)
    norm = posixpath.normpath(path)
    if not path or norm == "." or posixpath.isabs(path) or "\\" in path or ".." in norm.split("/"):
        raise FormatError(f"{label}: storage record points outside the checkpoint folder ({quote(path)})")
    return norm


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
    files = _Files(source)
    templates = _Templates(files)  # a run of items laid out alike: one comparison each

    def run(batch: list[_Job]) -> list[Any]:
        results: list[Any] = []
        window = _Window(source)
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


# the most bytes read ahead for the next items of a file read in order
_READ_AHEAD = 1 << 20


class _Files:
    """What an item's storage record names, looked up once per distinct value rather than once
    per item: the data file's checked relative path, that it is no folder, and its size. Only
    what passed is remembered: a bad path or a missing file is refused by every item naming it."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.label = source.label("")
        self._paths: dict[str, str] = {}
        self._sizes: dict[str, int] = {}

    def relpath(self, path: Any, what: str) -> str:
        rel = self._paths.get(path) if type(path) is str else None
        if rel is None:
            rel = _safe_relpath(path, f"{self.label} ({what})")
            if type(path) is str:
                self._paths[path] = rel
        return rel

    def size(self, rel: str, what: str) -> int:
        size = self._sizes.get(rel)
        if size is None:
            if self.source.isdir(rel):
                raise FormatError(f"{self.source.label(rel)}: is a folder, but the {what} points at it as a data file")
            size = self._sizes[rel] = self.source.size(rel)
        return size


class _Window:
    """Bytes of one data file read ahead for the next small items: DCP writes a file's items back
    to back, so a run of them costs one read instead of one per item. It reads ahead only while
    the items come in file order (each where the last ended), doubling up to _READ_AHEAD, and
    never past the file's end; items out of order are read alone, as before."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.rel: str | None = None
        self.start = 0
        self.data = b""
        self.ahead = 0
        self.last = -1  # where the last item served ended

    def read(self, rel: str, offset: int, length: int, size: int) -> bytes:
        at = offset - self.start
        if rel == self.rel and 0 <= at and at + length <= len(self.data):
            self.last = offset + length
            return self.data[at : at + length]
        in_order = rel == self.rel and offset == self.last
        self.ahead = min(_READ_AHEAD, max(length, 2 * self.ahead)) if in_order else 0
        self.data = self.source.read(rel, offset, min(size - offset, length + self.ahead))
        self.rel, self.start, self.last = rel, offset, offset + length
        return self.data[:length] if len(self.data) > length else self.data


# item templates: at most this many per (archive length, dtype, shape), and this many bytes in all
# (each holds two ints of its archive's size); kinds of item counted for learning, at most
_TEMPLATES_PER_KIND = 2
_TEMPLATE_BYTES = 16 << 20
_KINDS_COUNTED = 1 << 16


class _Templates:
    """The item templates of one read, by (archive length, dtype, shape): a template is learnt
    from an item that passed the full path, once a second item of its kind goes through it (a
    kind seen once is not worth one), and serves the next items of its kind laid out alike."""

    def __init__(self, files: _Files) -> None:
        self.files = files
        self._kinds: dict[tuple[int, str, tuple[int, ...]], list[_ItemTemplate]] = {}
        self._full: dict[tuple[int, str, tuple[int, ...]], int] = {}  # items of each kind read the full way
        self._bytes = 0

    def item(
        self, target: Any, box: Box | None, info: Any, window: _Window
    ) -> tuple[Piece, list[IntegrityCheck]] | None:
        """The item's (piece, checks) when a template serves it, exactly as _read_item would give
        them; None sends it through _read_item (which words any refusal)."""
        if type(target) is not TensorEntry or not self._kinds:
            return None
        fields = getattr(info, "__dict__", None)
        if fields is None:
            return None
        length = fields.get("length")
        templates = self._kinds.get((length, target.dtype, box.sizes)) if type(length) is int else None
        if templates is None:
            return None
        path, offset = fields.get("relative_path"), fields.get("offset")
        transforms = fields.get("transform_descriptors")
        rel = self.files._paths.get(path) if type(path) is str else None
        size = self.files._sizes.get(rel) if rel is not None else None
        if (
            size is None
            or type(offset) is not int
            or offset < 0
            or offset + length > size
            or not (transforms is None or (type(transforms) in (list, tuple) and not transforms))
        ):
            return None
        copy = window.read(rel, offset, length, size)
        if len(copy) != length:
            return None
        for template in templates:
            got = template.match(copy, offset, rel)
            if got is not None:
                return unchecked_piece(box, got[0]), got[1]  # (checked: see match)
        return None

    def learn(
        self, archive: Archive, dtype: str, size: tuple[int, ...], loc: Location, checks: list[IntegrityCheck]
    ) -> None:
        """Called with what _read_item gave for a small tensor item read whole (`archive.copy`)."""
        copy = archive.copy
        if copy is None:
            return
        kind = (len(copy), dtype, size)
        seen = self._full.get(kind, 0) + 1
        if len(self._full) < _KINDS_COUNTED or kind in self._full:
            self._full[kind] = seen
        known = self._kinds.get(kind, [])
        if seen < 2 or len(known) >= _TEMPLATES_PER_KIND or self._bytes + 2 * len(copy) > _TEMPLATE_BYTES:
            return
        template = _ItemTemplate.of(archive, dtype, size, loc, checks)
        if template is not None:
            self._kinds[kind] = known + [template]
            self._bytes += 2 * len(copy)


class _ItemTemplate:
    """What a small DCP item holding one tensor gave through _read_item's full path (open_archive,
    load_structure, tensor_location, the dtype and shape check, Archive.checks), kept to serve the
    next items of its kind at the cost of one comparison, one unpack of their CRC32 fields and
    the building of their piece and checks.

    Why a match gives what the full path gives: the comparison covers every byte of the zip layout
    the layout memo compares (ZipLayout's skeleton: all that open_archive's checks read but the
    CRC32 fields, which are unpacked here and, where the local header carries one, compared with
    the directory's as they would be) and every byte of data.pkl. An archive of the same length
    equal on them therefore gets from open_archive the same members (at its own offset, with its
    own CRCs: ZipLayout's argument), from load_structure the same tensor (the same data.pkl, over
    storage members of the same names and sizes), from tensor_location the same view checks and
    the same location relative to the archive, and its dtype and shape are the metadata's (the
    kind is looked up by them). Anything else goes through the full path, which refuses it with
    its own sentence or reads it."""

    __slots__ = (
        "mask",
        "want",
        "central",
        "local",
        "compared",
        "ats",
        "sizes",
        "whats",
        "start",
        "length",
        "stride",
        "ident",
    )

    def __init__(
        self,
        mask: int,
        want: int,
        layout: ZipLayout,
        members: tuple[tuple[int, int, str], ...],
        start: int,
        length: int,
        stride: tuple[int, ...] | None,
        ident: tuple[int, int] | None,
    ) -> None:
        self.ident = ident  # the serialization id's bytes (relative to the archive): each file's own, checked as text
        self.mask, self.want = mask, want  # the bytes compared (as bits of a little-endian int), their values
        self.central, self.local, self.compared = layout.central, layout.local, layout.compared
        # each member's data (relative to the archive), size and check's name, as columns (CheckTable.add_members)
        self.ats, self.sizes, self.whats = (tuple(column) for column in zip(*members)) if members else ((), (), ())
        self.start, self.length, self.stride = start, length, stride  # the tensor's bytes (start relative
        # to the archive) and its element strides: its Location's fields

    @staticmethod
    def of(
        archive: Archive, dtype: str, size: tuple[int, ...], loc: Location, checks: list[IntegrityCheck]
    ) -> _ItemTemplate | None:
        """The template of `archive` (read whole), which gave `loc` and `checks`; None when its
        layout is not one the layout memo can remember, or the template would not give them."""
        copy, offset = archive.copy, archive.base
        plain = plain_directory(copy)
        pkl = archive.members.get(f"{archive.prefix}/data.pkl")
        layout = (
            ZipLayout.of(copy, offset, plain[1], archive.members, archive.prefix)
            if plain is not None and pkl is not None
            else None
        )
        if layout is None:
            return None
        mask = bytearray(len(copy))
        at = pkl.data_offset - offset
        records = [
            (m.data_offset - offset, m.data_offset - offset + m.size)  # (what check_records read)
            for m in map(archive.members.get, record_names(archive.prefix))
            if m is not None
        ]
        for a, b in (*layout.segments, (at, at + pkl.size), *records):
            mask[a:b] = b"\xff" * (b - a)
        bits = int.from_bytes(mask, "little")
        members = tuple((m.data_offset - offset, m.size, f"zip member {m.name}") for m in archive.members.values())
        ident = archive.members.get(ident_name(archive.prefix))
        at_ident = (ident.data_offset - offset, ident.size) if ident is not None else None
        template = _ItemTemplate(
            bits,
            int.from_bytes(copy, "little") & bits,
            layout,
            members,
            loc.offset - offset,
            loc.length,
            loc.stride,
            at_ident,
        )
        got = template.match(copy, offset, archive.file)  # (one CRC a member: add_members's columns stay aligned)
        if (
            loc.encoding is not Encoding.RAW
            or loc.transforms
            or got is None
            or got[0] != loc
            or len(got[1].crcs) != len(template.ats)
            or list(got[1]) != checks
        ):
            return None  # (never expected: the template gives exactly what the full path gave, or nothing)
        return template

    def match(self, copy: bytes, offset: int, file: str) -> tuple[Location, _MatchedChecks] | None:
        """The location and checks of the archive `copy` (at `offset` of `file`) when it is laid
        out like this template's, else None."""
        if int.from_bytes(copy, "little") & self.mask != self.want:
            return None
        if self.ident is not None and not ident_is_text(copy[self.ident[0] : self.ident[0] + self.ident[1]]):
            return None  # the full path refuses it, with its message
        crcs = self.central.unpack_from(copy)
        if self.compared and self.local.unpack_from(copy) != tuple([crcs[i] for i in self.compared]):
            return None  # the full path refuses it, with its message
        loc = unchecked_location(file, offset + self.start, self.length, Encoding.RAW, self.stride)
        return loc, _MatchedChecks(self, file, offset, crcs)


class _MatchedChecks:
    """The checks of an item a template served, not built: 700k IntegrityChecks of a 100k-item
    checkpoint were made only to be taken apart into the index's CheckTable (issue 17), which
    takes these columns as they are (`add_to`). Iterates as, and equals, the list the full path
    (Archive.checks) gives."""

    __slots__ = ("template", "file", "offset", "crcs")

    def __init__(self, template: _ItemTemplate, file: str, offset: int, crcs: tuple[int, ...]) -> None:
        self.template, self.file, self.offset, self.crcs = template, file, offset, crcs

    def add_to(self, table: CheckTable) -> None:
        t = self.template
        table.add_members(self.file, self.offset, t.ats, t.sizes, self.crcs, t.whats)

    def __iter__(self) -> Iterator[IntegrityCheck]:
        file, offset = self.file, self.offset
        return iter(
            [
                new_tuple(IntegrityCheck, (file, offset + at, size, crc, what))
                for at, size, crc, what in zip(self.template.ats, self.template.sizes, self.crcs, self.template.whats)
            ]
        )

    def __len__(self) -> int:
        return len(self.crcs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, _MatchedChecks)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


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
        if type(checks) is _MatchedChecks:
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
        return source.label(_safe_relpath(path, source.label("")))
    except CkptkitError:
        return source.label("")


def _read_item(
    source: Source,
    target: Any,
    box: Box | None,
    info: Any,
    memo: StructureMemo | None = None,
    files: _Files | None = None,
    window: _Window | None = None,
    learn: _Templates | None = None,
):
    files = files if files is not None else _Files(source)
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
