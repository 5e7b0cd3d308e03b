"""DCP's `.metadata` as torch writes it, read at C speed: Python's C unpickler, fenced in.

A `.metadata` of 100k tensors is 10M opcodes; ckptkit's own pickle machine (safeload.vm) spends
~0.7 us on each, while Python's C unpickler builds the same objects 5x faster. It runs inside
safeload.fence's fences (the opcodes scanned first; only the grammar's own values and rules for
the DCP stand-ins, torch.Size, dtypes, layouts, memory formats and paths), and this road adds
two more on the result, else `load` hands back None and the restricted machine reads the file:

- the result's shape: torch's DCP Metadata field for field (`_Shape`), every field of the
   type torch writes, so that nothing else (no deep nesting, no foreign value) comes through
   (Megatron-Core's `all_local_plans` too: torch's SavePlan, WriteItem, WriteItemType and
   TensorWriteData, whose chunks and properties are the tensors' own, shared as pickled);
- nothing of unbounded size shared: each chunk list, planner path, transform list and top
   mapping is reached once, so a walk of the result costs what it holds (the small fixed-size
   objects, which torch never shares either, add a bounded amount each time they are reached),
   and the fixed shape leaves no room for a cycle.

What it returns equals what the restricted machine builds from the same bytes (tested on every
DCP fixture and on thousands of mutations of them).
"""

from __future__ import annotations

import pathlib
from typing import Any

from .fence import Call, Decline, SizeCall, run
from .grammar import LAYOUT, table
from .inert import inert_class
from .rules import extra_allowed
from ..torch_types import DType, GlobalRef, Size

__all__ = ["load"]

_META = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"

_GLOBALS: dict[tuple[str, str], Any] | None = None


def _globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> what the fast road gives for it: the grammar's own values."""
    global _GLOBALS
    if _GLOBALS is None:
        values, calls = table()
        found: dict[tuple[str, str], Any] = {}
        for (module, name), value in values.items():
            if module in (_META, _PLANNER, "torch.distributed.checkpoint.filesystem") and isinstance(value, type):
                found[(module, name)] = value  # stand-ins: NEWOBJ, REDUCE (Inert.__init__) and BUILD
            elif module == "torch" and (isinstance(value, (DType, GlobalRef)) or value is Size):
                entry = calls.get(id(value))
                found[(module, name)] = (
                    value if entry is None else SizeCall(entry[1]) if value is Size else Call(entry[1])
                )
            elif module == "pathlib" and id(value) in calls:  # StorageMeta.checkpoint_id (a Path)
                found[(module, name)] = Call(calls[id(value)][1])
            elif (module, name) == ("torch.serialization", "_get_layout"):
                found[(module, name)] = Call(calls[id(value)][1])
        _GLOBALS = found
    return _GLOBALS


# ---- the result's shape, nothing of unbounded size shared ---------------------------------------

_PATHS = (pathlib.PurePosixPath, pathlib.PureWindowsPath)  # what the grammar makes of pickled Paths
_LEAF_ARGS = {LAYOUT: str, f"{_META}._MEM_FORMAT_ENCODING": int}


def _classes() -> dict[str, type]:
    return {
        name: inert_class(name)
        for name in (
            f"{_META}.Metadata",
            f"{_META}.TensorStorageMetadata",
            f"{_META}.BytesStorageMetadata",
            f"{_META}.ChunkStorageMetadata",
            f"{_META}.TensorProperties",
            f"{_META}.MetadataIndex",
            f"{_META}.StorageMeta",
            _STORAGE_INFO,
            LAYOUT,
            f"{_META}._MEM_FORMAT_ENCODING",
            f"{_PLANNER}.SavePlan",
            f"{_PLANNER}.WriteItem",
            f"{_PLANNER}.WriteItemType",
            f"{_PLANNER}.TensorWriteData",
        )
    }


class _Shape:
    """One walk over the result: torch's DCP Metadata, nothing of unbounded size met twice.
    (Hundreds of thousands of tensors: the loops over tensors and storage records are flat.)"""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.classes = _classes()
        self.leaves: set[int] = set()  # layouts and memory formats already checked
        self.bulk: list[int] = []  # ids of the chunk lists met in the loop over tensors
        self.met = self.bulk.append

    def all_once(self) -> None:
        """No container of unbounded size met twice: the chunk lists (gathered as ids, compared
        at the end, which costs less than a set lookup each) and the others (`seen`)."""
        unique = set(self.bulk)
        if len(unique) != len(self.bulk) or not unique.isdisjoint(self.seen):
            raise Decline

    def once(self, value: Any) -> None:
        key = id(value)
        if key in self.seen:
            raise Decline
        self.seen.add(key)

    def fields(self, value: Any, qualname: str, allowed: frozenset) -> dict:
        if type(value) is not self.classes[qualname]:
            raise Decline
        self.once(value)
        got = value.__dict__
        if not got.keys() <= allowed:
            raise Decline
        return got

    def leaf(self, value: Any, qualname: str) -> None:
        """A layout or memory format: one str or int argument; may be shared (torch memoizes it)."""
        if id(value) in self.leaves:
            return
        if type(value) is not self.classes[qualname]:
            raise Decline
        got = value.__dict__
        args = got.get("_args")
        if len(got) != 1 or type(args) is not tuple or len(args) != 1 or type(args[0]) is not _LEAF_ARGS[qualname]:
            raise Decline
        self.leaves.add(id(value))
        self.seen.add(id(args))  # (its arguments are its own)

    def metadata(self, md: Any) -> None:
        got = self.fields(md, f"{_META}.Metadata", _METADATA_FIELDS)
        version = got.get("version")
        if version is not None and type(version) is not str:
            raise Decline
        sd = got.get("state_dict_metadata")
        if type(sd) is not dict:
            raise Decline
        self.once(sd)
        self.tensors(sd)
        self.storage_data(got.get("storage_data"))
        self.planner_data(got.get("planner_data"))
        self.storage_meta(got.get("storage_meta"))
        self.local_plans(got.get("all_local_plans"))
        self.all_once()

    def local_plans(self, plans: Any) -> None:
        """Megatron-Core's `all_local_plans`: each rank's SavePlan, its WriteItems naming a chunk
        (or a bytes item) as torch's planner made them. Their small fixed-size parts (chunks,
        properties, indexes) are the very objects the tensors' metadata holds: shared, as pickled."""
        if plans is None:
            return
        if type(plans) is not list:
            raise Decline
        self.once(plans)
        for plan in plans:
            got = self.fields(plan, f"{_PLANNER}.SavePlan", _PLAN_FIELDS)
            if got.get("storage_data") is not None or type(got.get("usable", True)) is not bool:
                raise Decline
            self.planner_data(got.get("planner_data"))
            items = got.get("items")
            if type(items) is not list:
                raise Decline
            self.once(items)
            for item in items:
                self.write_item(item)

    def write_item(self, item: Any) -> None:
        got = self.fields(item, f"{_PLANNER}.WriteItem", _WRITE_ITEM_FIELDS)
        if got.get("bytes_io_data") is not None:
            raise Decline
        self.metadata_index(got.get("index"))
        kind = got.get("type")  # an Enum member, WriteItemType(n): one int argument; shared, as pickled
        if id(kind) not in self.leaves:
            if type(kind) is not self.classes[f"{_PLANNER}.WriteItemType"]:
                raise Decline
            args = kind.__dict__.get("_args")
            if len(kind.__dict__) != 1 or type(args) is not tuple or len(args) != 1 or type(args[0]) is not int:
                raise Decline
            self.leaves.add(id(kind))
            self.seen.add(id(args))
        data = got.get("tensor_data")
        if data is None:
            return
        fields = self.fields(data, f"{_PLANNER}.TensorWriteData", _TENSOR_WRITE_FIELDS)
        if len(fields) != 3 or type(fields["size"]) is not Size:
            raise Decline
        self.chunk(fields["chunk"])
        self.properties(fields["properties"])

    def metadata_index(self, index: Any) -> None:
        if type(index) is not self.classes[f"{_META}.MetadataIndex"]:
            raise Decline
        key = index.__dict__
        offset, number = key.get("offset"), key.get("index")
        if not key.keys() <= _INDEX_FIELDS or type(key.get("fqn")) is not str:
            raise Decline
        if (number is not None and type(number) is not int) or (offset is not None and type(offset) is not Size):
            raise Decline

    def chunk(self, chunk: Any) -> None:
        fields = chunk.__dict__
        if type(chunk) is not self.classes[f"{_META}.ChunkStorageMetadata"] or len(fields) != 2:
            raise Decline
        if type(fields.get("offsets")) is not Size or type(fields.get("sizes")) is not Size:
            raise Decline

    def properties(self, props: Any) -> None:
        state = props.__dict__.get("_state")
        if type(props) is not self.classes[f"{_META}.TensorProperties"] or len(props.__dict__) != 1:
            raise Decline
        if type(state) is not tuple or len(state) != 5:
            raise Decline
        dtype, layout, requires_grad, memory_format, pin_memory = state
        if type(dtype) is not DType or type(requires_grad) is not bool or type(pin_memory) is not bool:
            raise Decline
        if id(layout) not in self.leaves:
            self.leaf(layout, LAYOUT)
        if id(memory_format) not in self.leaves:
            self.leaf(memory_format, f"{_META}._MEM_FORMAT_ENCODING")

    def tensors(self, sd: dict) -> None:
        """(A torch.Size is made only by the grammar's rule, which checked its ints.)"""
        met = self.met
        classes = self.classes
        tensor_cls, bytes_cls = classes[f"{_META}.TensorStorageMetadata"], classes[f"{_META}.BytesStorageMetadata"]
        chunk_cls, props_cls = classes[f"{_META}.ChunkStorageMetadata"], classes[f"{_META}.TensorProperties"]
        leaves = self.leaves
        for key, meta in sd.items():
            t = type(meta)
            if type(key) is not str or (t is not tensor_cls and t is not bytes_cls):
                raise Decline
            got = meta.__dict__
            if t is bytes_cls:
                if got:
                    raise Decline
                continue
            if len(got) != 3 or not got.keys() <= _TENSOR_FIELDS:
                raise Decline
            props, size, chunks = got["properties"], got["size"], got["chunks"]
            if type(props) is not props_cls or type(size) is not Size or type(chunks) is not list:
                raise Decline
            state = props.__dict__.get("_state")
            if len(props.__dict__) != 1 or type(state) is not tuple or len(state) != 5:
                raise Decline
            met(id(chunks))
            dtype, layout, requires_grad, memory_format, pin_memory = state
            if type(dtype) is not DType or type(requires_grad) is not bool or type(pin_memory) is not bool:
                raise Decline
            if id(layout) not in leaves:
                self.leaf(layout, LAYOUT)
            if id(memory_format) not in leaves:
                self.leaf(memory_format, f"{_META}._MEM_FORMAT_ENCODING")
            for chunk in chunks:
                fields = chunk.__dict__
                if type(chunk) is not chunk_cls or len(fields) != 2:
                    raise Decline
                offsets, sizes = fields.get("offsets"), fields.get("sizes")
                if type(offsets) is not Size or type(sizes) is not Size:
                    raise Decline

    def optional_mapping(self, value: Any) -> dict:
        """A dict met once ({} for None: storage_data and planner_data may be absent)."""
        if value is None:
            return {}
        if type(value) is not dict:
            raise Decline
        self.once(value)
        return value

    def storage_data(self, storage: Any) -> None:
        storage = self.optional_mapping(storage)
        index_cls, info_cls = self.classes[f"{_META}.MetadataIndex"], self.classes[_STORAGE_INFO]
        for index, info in storage.items():
            if type(index) is not index_cls or type(info) is not info_cls:
                raise Decline
            key, got = index.__dict__, info.__dict__
            if not key.keys() <= _INDEX_FIELDS or not got.keys() <= _STORAGE_INFO_FIELDS:
                raise Decline
            offset, number = key.get("offset"), key.get("index")
            if type(key.get("fqn")) is not str or (number is not None and type(number) is not int):
                raise Decline
            if offset is not None and type(offset) is not Size:
                raise Decline
            if (
                type(got.get("relative_path")) is not str
                or type(got.get("offset")) is not int
                or type(got.get("length")) is not int
            ):
                raise Decline
            transforms = got.get("transform_descriptors")
            if transforms is not None:
                self.strings(transforms)

    def strings(self, value: Any) -> None:
        """A list or tuple of strings."""
        if type(value) is not list and type(value) is not tuple:
            raise Decline
        self.once(value)
        for x in value:
            if type(x) is not str:
                raise Decline

    def planner_data(self, planner: Any) -> None:
        planner = self.optional_mapping(planner)
        seen, add = self.seen, self.seen.add
        for key, path in planner.items():
            if type(key) is not str or (type(path) is not tuple and type(path) is not list) or id(path) in seen:
                raise Decline
            add(id(path))
            if not set(map(type, path)) <= _STR_OR_INT:
                raise Decline

    def storage_meta(self, meta: Any) -> None:
        if meta is None:
            return
        got = self.fields(meta, f"{_META}.StorageMeta", _STORAGE_META_FIELDS)
        for name in ("save_id", "load_id"):
            if got.get(name) is not None and type(got[name]) is not str:
                raise Decline
        path = got.get("checkpoint_id")
        if path is not None and type(path) is not str:
            if type(path) not in _PATHS:
                raise Decline
            # a path is a slotted object, whose slots a BUILD could have set: keep one made afresh
            # from its text, which must give the same path
            fresh = type(path)(str(path))
            if fresh != path or str(fresh) != str(path):
                raise Decline
            got["checkpoint_id"] = fresh
        if got.get("modules") is not None:
            self.strings(got["modules"])


_STR_OR_INT = {str, int}
_METADATA_FIELDS = frozenset(
    {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version", "all_local_plans"}
)
_PLAN_FIELDS = frozenset({"items", "storage_data", "planner_data", "usable"})
_WRITE_ITEM_FIELDS = frozenset({"index", "type", "tensor_data", "bytes_io_data"})
_TENSOR_WRITE_FIELDS = frozenset({"chunk", "properties", "size"})
_TENSOR_FIELDS = frozenset({"properties", "size", "chunks"})
_INDEX_FIELDS = frozenset({"fqn", "offset", "index"})
_STORAGE_INFO_FIELDS = frozenset({"relative_path", "offset", "length", "transform_descriptors"})
_STORAGE_META_FIELDS = frozenset({"checkpoint_id", "save_id", "load_id", "modules"})


def load(data: bytes) -> Any | None:
    """The Metadata stand-in `data` pickles, or None where the fast road does not take it (the
    caller runs the restricted machine then)."""
    names = _globals()
    extra = extra_allowed()
    if any(key in extra for key in names):
        return None  # a format re-mapped one of these globals: only the grammar knows what to build
    return run(data, names, lambda value: _Shape().metadata(value))
