"""DCP's `.metadata` as torch writes it, read at C speed: Python's C unpickler, fenced in.

A `.metadata` of 100k tensors is 10M opcodes; ckptkit's own pickle machine (safeload_vm) spends
~0.7 us on each, while Python's C unpickler builds the same objects 5x faster. The C unpickler
alone is no restricted loader (a 9-byte LONG_BINPUT makes it allocate gigabytes; it builds any
nesting and any sharing), so it runs here only inside four fences, and `load` hands back None
(the caller then runs the restricted machine, which accepts or words the refusal) whenever one
of them does not hold:

1. the opcodes (a scan at regex speed before anything is built): protocol 2 to 5; only the
   opcodes torch's pickler (protocol 4) and ckptkit's DCP writer (protocol 2) write there, no
   memo index past the pickle's length (the C unpickler sizes its memo for the index a PUT
   names), no floats, sets, bytes, persistent ids, extensions or protocol-0 text but GLOBAL's
   two lines; every length within the input and the blob limit; integers of at most 8 bytes,
   and few of more than 4 (ints of up to 4 bytes cannot be crafted into tuples that share a
   hash, so no dictionary can be made quadratic); containers at most the machine's object
   limit (counted from their opcodes' bytes, an upper bound);
2. the globals: the DCP stand-in classes, torch.Size, dtypes, layouts, memory formats and paths,
   mapped to exactly what the restricted grammar maps them to, its rules checking each call;
   none of them takes a state (BUILD) except the stand-ins, which take it as the grammar gives it
   (safeload_inert.apply_inert_state);
3. the result's shape: torch's DCP Metadata field for field (`_Shape`), every field of the
   type torch writes, so that nothing else (no deep nesting, no foreign value) comes through;
4. no sharing: every container is reached once (layouts and memory formats, which hold one
   string or int, aside), so the result expands to no more than it holds and holds no cycle.

What it returns equals what the restricted machine builds from the same bytes (tested on every
DCP fixture and on thousands of mutations of them).
"""
from __future__ import annotations

import gc
import io
import pathlib
import pickle
import re
from functools import lru_cache
from itertools import chain
from typing import Any

from . import knobs
from .safeload_grammar import _LAYOUT, table
from .safeload_inert import inert_class
from .safeload_rules import Refused, extra_allowed
from .torch_types import DType, GlobalRef, Size

__all__ = ["load"]

_META = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"

# ---- 1. the opcodes ------------------------------------------------------------------------------

# opcodes without an argument that DCP metadata may use (and harmless others: POP, DUP, LIST,
# DICT, SETITEM ...); STOP ends the scan, in Python
_NO_ARG = b"(012N)]}abelstu\x85\x86\x87\x88\x89\x81\x93\x94Rd"


@lru_cache(maxsize=None)
def _run(top: int) -> re.Pattern:
    """Opcodes with no argument or one of fixed size: BINGET, BINPUT, BININT1 (1 byte); BININT2
    (2); LONG_BINGET, BININT (4); FRAME (8); and LONG_BINPUT of an index below (top + 1) * 2**16."""
    no_arg = b"".join(re.escape(bytes([c])) for c in _NO_ARG)
    put = b"r..[\\x00-" + re.escape(bytes([top])) + b"]\\x00" if top < 256 else b"r...\\x00"
    return re.compile(b"(?:[" + no_arg + b"]|[hqK].|M..|[jJ]....|\\x95.{8}|" + put + b")*+", re.DOTALL)


def _run_for(n: int) -> re.Pattern:
    """LONG_BINPUT (protocol 2, ckptkit's own writer) makes the C unpickler size its memo for the
    index named (a 9-byte pickle could ask for gigabytes): the scan lets an index pass at most
    the pickle's length (one entry per input byte: a pickler numbers its entries from 0), inline
    up to the largest multiple of 2**16 below it (2**16 at least, 2**24 at most), beyond that
    one by one."""
    return _run(min(256, max(1, n >> 16)) - 1 if n < 1 << 24 else 256)


# opcodes that make a container or a rebuilt value: their bytes counted bound the objects made
_MAKERS = b")]}ltd\x85\x86\x87\x81R"
# integers of 5-8 bytes (LONG1): storage offsets past 2 GiB. Each could seed a tuple key crafted to
# collide with others; this many cost a dictionary at most ~1e8 probes
MAX_WIDE_INTS = 1 << 14
# the longest module or name line of a GLOBAL (protocol 2)
_MAX_NAME = 256


class _Decline(Exception):
    """The fast road does not take this pickle: the restricted machine reads it."""


def _scan(data: bytes) -> None:
    """Raise _Decline unless `data` is made only of the opcodes above, within the limits."""
    n = len(data)
    if n < 3 or data[0] != 0x80 or not 2 <= data[1] <= 5:
        raise _Decline
    blob = knobs.MAX_PICKLE_BLOB
    match = _run_for(n).match
    wide = 0
    pos = 2
    while True:
        pos = match(data, pos).end()
        if pos >= n:
            raise _Decline  # no STOP
        op = data[pos]
        if op == 0x8C:  # SHORT_BINUNICODE
            if pos + 1 >= n:
                raise _Decline
            pos += 2 + data[pos + 1]
        elif op == 0x58 or op == 0x8D:  # BINUNICODE, BINUNICODE8
            width = 4 if op == 0x58 else 8
            size = int.from_bytes(data[pos + 1:pos + 1 + width], "little")
            if size > blob:
                raise _Decline
            pos += 1 + width + size
        elif op == 0x8A:  # LONG1
            if pos + 1 >= n or data[pos + 1] > 8:
                raise _Decline
            if data[pos + 1] > 4:
                wide += 1
                if wide > MAX_WIDE_INTS:
                    raise _Decline
            pos += 2 + data[pos + 1]
        elif op == 0x72:  # LONG_BINPUT past the inline bound
            if int.from_bytes(data[pos + 1:pos + 5], "little") > max(n, 1 << 16):
                raise _Decline
            pos += 5
        elif op == 0x63:  # GLOBAL: two lines
            end = data.find(b"\n", pos + 1, pos + 2 + _MAX_NAME)
            end = data.find(b"\n", end + 1, end + 2 + _MAX_NAME) if end >= 0 else -1
            if end < 0:
                raise _Decline
            pos = end + 1
        elif op == 0x2E:  # STOP
            break
        else:
            raise _Decline
        if pos > n:
            raise _Decline
    objects = sum(data.count(bytes([c])) for c in _MAKERS)
    if objects > max(knobs.MAX_PICKLE_OBJECTS, n // 4):
        raise _Decline


# ---- 2. the globals ------------------------------------------------------------------------------

class _Call:
    """A global the grammar lets a pickle call: its rule builds the value. Takes no state and
    no attributes (a pickle cannot change it for the next one)."""

    __slots__ = ("_rule",)

    def __init__(self, rule: Any) -> None:
        object.__setattr__(self, "_rule", rule)

    def __call__(self, *args: Any) -> Any:
        try:
            return self._rule(args)
        except Refused:
            raise _Decline from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise _Decline

    def __setstate__(self, state: Any) -> None:
        raise _Decline


_GLOBALS: dict[tuple[str, str], Any] | None = None


def _globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> what the fast road gives for it: the grammar's own values."""
    global _GLOBALS
    if _GLOBALS is None:
        values, calls = table()
        found: dict[tuple[str, str], Any] = {}
        for (module, name), value in values.items():
            if module in (_META, "torch.distributed.checkpoint.filesystem") and isinstance(value, type):
                found[(module, name)] = value  # stand-ins: NEWOBJ, REDUCE (Inert.__init__) and BUILD
            elif module == "torch" and (isinstance(value, (DType, GlobalRef)) or value is Size):
                entry = calls.get(id(value))
                found[(module, name)] = _Call(entry[1]) if entry is not None else value
            elif module == "pathlib" and id(value) in calls:  # StorageMeta.checkpoint_id (a Path)
                found[(module, name)] = _Call(calls[id(value)][1])
            elif (module, name) == ("torch.serialization", "_get_layout"):
                found[(module, name)] = _Call(calls[id(value)][1])
        _GLOBALS = found
    return _GLOBALS


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, names: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data), fix_imports=False)
        self._names = names

    def find_class(self, module: str, name: str) -> Any:
        value = self._names.get((module, name))
        if value is None:
            raise _Decline
        return value


# ---- 3 and 4. the result's shape, nothing shared -------------------------------------------------

_PATHS = (pathlib.PurePosixPath, pathlib.PureWindowsPath)  # what the grammar makes of pickled Paths
_LEAF_ARGS = {_LAYOUT: str, f"{_META}._MEM_FORMAT_ENCODING": int}


def _classes() -> dict[str, type]:
    return {name: inert_class(name) for name in (
        f"{_META}.Metadata", f"{_META}.TensorStorageMetadata", f"{_META}.BytesStorageMetadata",
        f"{_META}.ChunkStorageMetadata", f"{_META}.TensorProperties", f"{_META}.MetadataIndex",
        f"{_META}.StorageMeta", _STORAGE_INFO, _LAYOUT, f"{_META}._MEM_FORMAT_ENCODING")}


class _Shape:
    """One walk over the result: torch's DCP Metadata, each container met once. (Hundreds of
    thousands of tensors: the loops over tensors and storage records are written out flat.)"""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.classes = _classes()
        self.leaves: set[int] = set()  # layouts and memory formats already checked
        self.bulk: list[tuple] = []   # tuples of ids of the containers met in the long loops
        self.met = self.bulk.append

    def all_once(self) -> None:
        """No container met twice: those of the long loops (gathered as ids, compared at the end,
        which costs less than a set lookup each), and the others (`seen`)."""
        ids = list(chain.from_iterable(self.bulk))
        unique = set(ids)
        if len(unique) != len(ids) or not unique.isdisjoint(self.seen):
            raise _Decline

    def once(self, value: Any) -> None:
        key = id(value)
        if key in self.seen:
            raise _Decline
        self.seen.add(key)

    def fields(self, value: Any, qualname: str, allowed: frozenset) -> dict:
        if type(value) is not self.classes[qualname]:
            raise _Decline
        self.once(value)
        got = value.__dict__
        if not got.keys() <= allowed:
            raise _Decline
        return got

    def leaf(self, value: Any, qualname: str) -> None:
        """A layout or memory format: one str or int argument; may be shared (torch memoizes it)."""
        if id(value) in self.leaves:
            return
        if type(value) is not self.classes[qualname]:
            raise _Decline
        got = value.__dict__
        args = got.get("_args")
        if len(got) != 1 or type(args) is not tuple or len(args) != 1 or type(args[0]) is not _LEAF_ARGS[qualname]:
            raise _Decline
        self.leaves.add(id(value))
        self.seen.add(id(args))  # (its arguments are its own)

    def metadata(self, md: Any) -> None:
        got = self.fields(md, f"{_META}.Metadata", _METADATA_FIELDS)
        version = got.get("version")
        if version is not None and type(version) is not str:
            raise _Decline
        sd = got.get("state_dict_metadata")
        if type(sd) is not dict:
            raise _Decline
        self.once(sd)
        self.tensors(sd)
        self.storage_data(got.get("storage_data"))
        self.planner_data(got.get("planner_data"))
        self.storage_meta(got.get("storage_meta"))
        self.all_once()

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
                raise _Decline
            got = meta.__dict__
            if t is bytes_cls:
                if got:
                    raise _Decline
                met((id(meta),))
                continue
            if len(got) != 3 or not got.keys() <= _TENSOR_FIELDS:
                raise _Decline
            props, size, chunks = got["properties"], got["size"], got["chunks"]
            if type(props) is not props_cls or type(size) is not Size or type(chunks) is not list:
                raise _Decline
            state = props.__dict__.get("_state")
            if len(props.__dict__) != 1 or type(state) is not tuple or len(state) != 5:
                raise _Decline
            met((id(meta), id(props), id(size), id(chunks), id(state)))
            dtype, layout, requires_grad, memory_format, pin_memory = state
            if type(dtype) is not DType or type(requires_grad) is not bool or type(pin_memory) is not bool:
                raise _Decline
            if id(layout) not in leaves:
                self.leaf(layout, _LAYOUT)
            if id(memory_format) not in leaves:
                self.leaf(memory_format, f"{_META}._MEM_FORMAT_ENCODING")
            for chunk in chunks:
                fields = chunk.__dict__
                if type(chunk) is not chunk_cls or len(fields) != 2:
                    raise _Decline
                offsets, sizes = fields.get("offsets"), fields.get("sizes")
                if type(offsets) is not Size or type(sizes) is not Size:
                    raise _Decline
                met((id(chunk), id(offsets), id(sizes)))

    def storage_data(self, storage: Any) -> None:
        if storage is None:
            return
        if type(storage) is not dict:
            raise _Decline
        self.once(storage)
        met = self.met
        index_cls, info_cls = self.classes[f"{_META}.MetadataIndex"], self.classes[_STORAGE_INFO]
        for index, info in storage.items():
            if type(index) is not index_cls or type(info) is not info_cls:
                raise _Decline
            key, got = index.__dict__, info.__dict__
            if not key.keys() <= _INDEX_FIELDS or not got.keys() <= _STORAGE_INFO_FIELDS:
                raise _Decline
            offset, number = key.get("offset"), key.get("index")
            if type(key.get("fqn")) is not str or (number is not None and type(number) is not int):
                raise _Decline
            if offset is not None:
                if type(offset) is not Size:
                    raise _Decline
                met((id(offset),))
            met((id(index), id(info)))
            if type(got.get("relative_path")) is not str or type(got.get("offset")) is not int or \
                    type(got.get("length")) is not int:
                raise _Decline
            transforms = got.get("transform_descriptors")
            if transforms is not None:
                self.strings(transforms)

    def strings(self, value: Any) -> None:
        """A list or tuple of strings."""
        if type(value) is not list and type(value) is not tuple:
            raise _Decline
        self.once(value)
        for x in value:
            if type(x) is not str:
                raise _Decline

    def planner_data(self, planner: Any) -> None:
        if planner is None:
            return
        if type(planner) is not dict:
            raise _Decline
        self.once(planner)
        seen, add = self.seen, self.seen.add
        for key, path in planner.items():
            if type(key) is not str or (type(path) is not tuple and type(path) is not list) or id(path) in seen:
                raise _Decline
            add(id(path))
            if not set(map(type, path)) <= _STR_OR_INT:
                raise _Decline

    def storage_meta(self, meta: Any) -> None:
        if meta is None:
            return
        got = self.fields(meta, f"{_META}.StorageMeta", _STORAGE_META_FIELDS)
        for name in ("save_id", "load_id"):
            if got.get(name) is not None and type(got[name]) is not str:
                raise _Decline
        path = got.get("checkpoint_id")
        if path is not None and type(path) is not str and type(path) not in _PATHS:
            raise _Decline
        if got.get("modules") is not None:
            self.strings(got["modules"])


_INT = {int}
_STR_OR_INT = {str, int}
_METADATA_FIELDS = frozenset({"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"})
_TENSOR_FIELDS = frozenset({"properties", "size", "chunks"})
_CHUNK_FIELDS = frozenset({"offsets", "sizes"})
_PROPERTIES_FIELDS = frozenset({"_state"})
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
    collecting = gc.isenabled()
    if collecting:
        gc.disable()  # millions of new containers, none in a cycle
    try:
        _scan(data)
        value = _Unpickler(data, names).load()
        _Shape().metadata(value)
        return value
    except Exception:  # noqa: BLE001 - declined (or malformed): the restricted machine reads it and words why
        return None
    finally:
        if collecting:
            gc.enable()

