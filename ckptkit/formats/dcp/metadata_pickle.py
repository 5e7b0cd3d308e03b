"""DCP's `.metadata` written straight as pickle opcodes, without building stand-ins.

writer.metadata_stand_ins builds torch's Metadata classes as stand-ins and repickle pickles them
into torch's own bytes; at 100k chunks that makes and walks about a million objects. This module
writes the same opcodes from the written items: every object a chunk adds (its stand-ins, their
state dicts, its Sizes and their tuples) is new, so it only takes the next memo index (pickle's
memo counts up from 0) and needs no memo entry, while what may repeat (strings, globals, the
planner's path tuples, torch.strided) goes through a memo by identity, as pickle's does.
Anything it does not expect gives None, and the writer pickles the stand-ins instead; tests
compare both byte for byte.
"""

from __future__ import annotations

import gc
import pickle
import struct
import sys
from collections.abc import Sequence
from typing import Any

from ...index.types import CheckpointIndex

__all__ = ["metadata_pickle"]

_MD = "torch.distributed.checkpoint.metadata"
_STRIDED_NAME = "torch.strided"  # (a constant of its own: never the same object as a key read from a file)
_BATCH = 1000  # pickle's batch of items per APPENDS/SETITEMS (its Pickler's _BATCHSIZE): the same bytes
_I = struct.Struct("<I").pack
_i = struct.Struct("<i").pack
_H = struct.Struct("<H").pack
_NEW = pickle.EMPTY_TUPLE + pickle.NEWOBJ
_TUPLE_OPS = {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}
_END_STATE = pickle.SETITEMS + pickle.BUILD
_PUTS = [pickle.BINPUT + bytes((i,)) for i in range(256)]
_SMALL_INTS = [pickle.BININT1 + bytes((i,)) for i in range(256)]
_TORCH_SIZE = ("torch", "Size")
_CHUNK = (_MD, "ChunkStorageMetadata")
_INDEX = (_MD, "MetadataIndex")
_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def _put(n: int) -> bytes:
    return _PUTS[n] if n < 256 else pickle.LONG_BINPUT + _I(n)


_LONG_PUT = struct.Struct("<cI").pack


def _size_tail(dims: Sequence[int], n: int) -> tuple[bytes, int]:
    """A new torch.Size after its class's GET, once memo indexes are past 255 (every PUT a
    LONG_BINPUT): its bytes and how many memo indexes it took."""
    k = len(dims)
    if not k:
        return pickle.EMPTY_TUPLE + pickle.TUPLE1 + _LONG_PUT(b"r", n) + pickle.REDUCE + _LONG_PUT(b"r", n + 1), 2
    ints = b"".join([_SMALL_INTS[v] if type(v) is int and 0 <= v <= 0xFF else _int(v) for v in dims])
    return b"".join(
        (
            pickle.MARK if k > 3 else b"",
            ints,
            _TUPLE_OPS[k] if k <= 3 else pickle.TUPLE,
            _LONG_PUT(b"r", n),
            pickle.TUPLE1,
            _LONG_PUT(b"r", n + 1),
            pickle.REDUCE,
            _LONG_PUT(b"r", n + 2),
        )
    ), 3


def _int(o: Any) -> bytes:
    """An int's opcode (ints are never memoized)."""
    if type(o) is not int:
        raise _Unexpected(type(o))
    if 0 <= o <= 0xFF:
        return _SMALL_INTS[o]
    if 0 <= o <= 0xFFFF:
        return pickle.BININT2 + _H(o)
    if -0x80000000 <= o <= 0x7FFFFFFF:
        return pickle.BININT + _i(o)
    encoded = pickle.encode_long(o)
    n = len(encoded)
    return pickle.LONG1 + bytes((n,)) + encoded if n < 256 else pickle.LONG4 + _i(n) + encoded


class _Unexpected(Exception):
    """A value this writer does not handle: the stand-ins are pickled instead."""


class _Emitter:
    """pickle._Pickler's protocol-2 output for the values below, with its memo numbering."""

    def __init__(self) -> None:
        self.out = bytearray(pickle.PROTO + b"\x02")
        self.n = 0  # the next memo index
        self.memo: dict[Any, bytes] = {}  # id (or a global's name) -> the opcode that gets it back
        self.held: list[Any] = []  # keeps memoized objects alive, so their ids stay unique

    def put(self) -> None:
        """Memoize a new object no one refers to again."""
        n = self.n
        self.out += pickle.BINPUT + bytes((n,)) if n < 256 else pickle.LONG_BINPUT + _I(n)
        self.n = n + 1

    def remember(self, key: Any) -> None:
        n = self.n
        self.memo[key] = pickle.BINGET + bytes((n,)) if n < 256 else pickle.LONG_BINGET + _I(n)
        self.put()

    def global_(self, module: str, name: str) -> None:
        got = self.memo.get((module, name))
        if got is not None:
            self.out += got
            return
        self.out += pickle.GLOBAL + f"{module}\n{name}\n".encode("utf-8")
        self.remember((module, name))

    def new(self, module: str, name: str) -> None:
        """A stand-in built by cls.__new__ (NEWOBJ), memoized; its state dict follows."""
        self.global_(module, name)
        self.out += _NEW
        self.put()

    def new_with_state(self, module: str, name: str) -> None:
        """A stand-in built by NEWOBJ with its state dict opened: its items follow, then _END_STATE."""
        self.global_(module, name)
        self.out += _NEW
        self.new_state()

    def str_(self, s: Any) -> None:
        if type(s) is not str:
            raise _Unexpected(type(s))
        got = self.memo.get(id(s))
        if got is not None:
            self.out += got
            return
        encoded = s.encode("utf-8", "surrogatepass")
        self.out += pickle.BINUNICODE + _I(len(encoded)) + encoded
        self.remember(id(s))
        self.held.append(s)

    def int_(self, o: Any) -> None:
        self.out += _int(o)

    def size(self, dims: Sequence[int]) -> None:
        """A new torch.Size: torch.Size((dims,)) by REDUCE; its tuple of ints is new too (the
        empty tuple is never memoized)."""
        out = self.out
        got = self.memo.get(_TORCH_SIZE)
        if got is None:
            self.global_(*_TORCH_SIZE)
        else:
            out += got
        n = self.n
        k = len(dims)
        if k:
            if k > 3:
                out += pickle.MARK
            for v in dims:
                out += _SMALL_INTS[v] if type(v) is int and 0 <= v <= 0xFF else _int(v)
            out += _TUPLE_OPS[k] if k <= 3 else pickle.TUPLE
            out += _PUTS[n] if n < 256 else pickle.LONG_BINPUT + _I(n)
            n += 1
        else:
            out += pickle.EMPTY_TUPLE
        out += pickle.TUPLE1
        out += _PUTS[n] if n < 256 else pickle.LONG_BINPUT + _I(n)
        out += pickle.REDUCE
        n += 1
        out += _PUTS[n] if n < 256 else pickle.LONG_BINPUT + _I(n)
        self.n = n + 1

    def new_state(self) -> None:
        """A stand-in's new state dict, its items to follow (the stand-in's NEWOBJ is written)."""
        n = self.n
        self.out += _put(n) + pickle.EMPTY_DICT + _put(n + 1) + pickle.MARK
        self.n = n + 2

    def value(self, o: Any) -> None:
        """A planner path: a tuple (memoized by identity: it may be the index's own) of strs and ints."""
        if type(o) is str:
            self.str_(o)
        elif type(o) is int:
            self.int_(o)
        elif type(o) is tuple and o:
            got = self.memo.get(id(o))
            if got is not None:
                self.out += got
                return
            if len(o) > 3:
                self.out += pickle.MARK
            for e in o:
                if type(e) is tuple:
                    raise _Unexpected(tuple)  # (nested: a recursive tuple is not worth the care)
                self.value(e)
            self.out += _TUPLE_OPS[len(o)] if len(o) <= 3 else pickle.TUPLE
            self.remember(id(o))
            self.held.append(o)
        else:
            raise _Unexpected(type(o))

    def batches(self, items: Sequence[Any], write_one: Any, many: bytes, one: bytes) -> None:
        """pickle's batched SETITEMS/APPENDS: runs of 1000, a run of one without MARK."""
        for start in range(0, len(items), _BATCH):
            batch = items[start : start + _BATCH]
            if len(batch) > 1:
                self.out += pickle.MARK
                for item in batch:
                    write_one(item)
                self.out += many
            else:
                write_one(batch[0])
                self.out += one


def metadata_pickle(
    index: CheckpointIndex, written: Sequence[Any], key_order: list[str] | None, save_id: str, version: str
) -> bytes | None:
    """The bytes repickle gives writer.metadata_stand_ins(index, written, key_order, save_id), or
    None where this writer does not know them (a repeated item, an unusual path or value)."""
    collecting = gc.isenabled()
    if collecting:  # ~10 objects a chunk, all alive until it returns, none in a cycle: collecting only costs
        gc.disable()
    try:
        return _metadata(index, written, key_order, save_id, version)
    except (_Unexpected, RecursionError):
        return None
    finally:
        if collecting:
            gc.enable()


def _metadata(
    index: CheckpointIndex, written: Sequence[Any], key_order: list[str] | None, save_id: str, version: str
) -> bytes | None:
    gathered = _gathered(index, written, key_order)
    if gathered is None:
        return None
    return _MetadataWriter().write(*gathered, save_id, version)


def _gathered(
    index: CheckpointIndex, written: Sequence[Any], key_order: list[str] | None
) -> tuple[dict[str, tuple[Any, list[Any]]], dict[str, Any], list[tuple[Any, ...]]] | None:
    """What the stand-ins hold, in their dicts' order: per state-dict key, its tensor entry (None
    for a bytes item) and chunks; per storage item, its key, chunk number, box and place; None
    where the stand-ins' keys would merge."""
    sd: dict[str, tuple[Any, list[Any]]] = {}
    planner: dict[str, Any] = {}
    storage: list[tuple[Any, ...]] = []
    for w in written:
        file = sys.intern(w.file)
        if w.box is None:
            obj = index.objects[w.key]
            key = obj.key
            if key in sd:  # a value written twice, or also a tensor: its stand-in keys would merge
                return None
            sd[key] = (None, [])
            storage.append((key, None, None, file, w.offset, w.length, w.transforms))
            planner[key] = tuple(obj.path) if obj.path else (key,)
            continue
        entry = index.tensors[w.key]
        key = entry.key
        known = sd.get(key)
        if known is None:
            known = sd[key] = (entry, [])
            planner[key] = tuple(entry.path) if entry.path else (key,)
        elif known[0] is not entry:
            return None
        known[1].append(w.box)
        storage.append((key, len(known[1]) - 1, w.box, file, w.offset, w.length, ()))
    if key_order is not None:
        position = {k: i for i, k in enumerate(key_order)}
        planner = {k: planner[k] for k in sorted(planner, key=lambda k: position.get(k, len(position)))}
    return sd, planner, storage


class _MetadataWriter:
    """One `.metadata` written as opcodes: the emitter, and the GETs of what every chunk and
    storage item names once all are memoized (`fast`), which the common items are joined from."""

    def __init__(self) -> None:
        self.e = _Emitter()
        self.out, self.memo = self.e.out, self.e.memo
        self.fast: dict[str, bytes] = {}

    def write(
        self,
        sd: dict[str, tuple[Any, list[Any]]],
        planner: dict[str, Any],
        storage: list[tuple[Any, ...]],
        save_id: str,
        version: str,
    ) -> bytes:
        """The whole `.metadata`: Metadata's state dict, its three mappings, storage_meta, version."""
        e, out = self.e, self.out
        e.new_with_state(_MD, "Metadata")
        e.str_("state_dict_metadata")
        out += pickle.EMPTY_DICT
        e.put()
        e.batches(list(sd.items()), self.sd_item, pickle.SETITEMS, pickle.SETITEM)
        e.str_("planner_data")
        out += pickle.EMPTY_DICT
        e.put()
        e.batches(list(planner.items()), self.planner_item, pickle.SETITEMS, pickle.SETITEM)
        e.str_("storage_data")
        out += pickle.EMPTY_DICT
        e.put()
        e.batches(storage, self.storage_item, pickle.SETITEMS, pickle.SETITEM)
        e.str_("storage_meta")
        e.new_with_state(_MD, "StorageMeta")
        e.str_("checkpoint_id")
        out += pickle.NONE
        e.str_("save_id")
        e.str_(save_id)
        e.str_("load_id")
        out += pickle.NONE
        e.str_("modules")
        out += pickle.EMPTY_LIST
        e.put()
        out += _END_STATE
        e.str_("version")
        e.str_(version)
        out += _END_STATE + pickle.STOP
        return bytes(out)

    def chunk(self, box: Any) -> None:
        """A chunk's ChunkStorageMetadata: joined from `fast` in the common case, else written whole
        (and `fast` learnt once all it names is memoized)."""
        e, out, memo, fast = self.e, self.out, self.memo, self.fast
        got = fast.get("chunk")
        n = e.n
        if got is not None and n >= 256:  # the common case, as one join: GETs and LONG_BINPUTs
            offsets, used = _size_tail(box.offsets, n + 2)
            sizes, used2 = _size_tail(box.sizes, n + 2 + used)
            out.extend(
                b"".join(
                    (
                        got,
                        _LONG_PUT(b"r", n),
                        pickle.EMPTY_DICT,
                        _LONG_PUT(b"r", n + 1),
                        pickle.MARK,
                        fast["offsets"],
                        offsets,
                        fast["sizes"],
                        sizes,
                        _END_STATE,
                    )
                )
            )
            e.n = n + 2 + used + used2
            return
        self.chunk_whole(box)
        names = [memo.get(k) for k in (_CHUNK, id("offsets"), _TORCH_SIZE, id("sizes"))]
        if None not in names:
            fast["chunk"] = names[0] + _NEW
            fast["offsets"] = names[1] + names[2]
            fast["sizes"] = names[3] + names[2]

    def chunk_whole(self, box: Any) -> None:
        """A ChunkStorageMetadata written opcode by opcode."""
        e, out = self.e, self.out
        self.new_with(_CHUNK, ("offsets",))
        e.size(box.offsets)
        e.str_("sizes")
        e.size(box.sizes)
        out.extend(_END_STATE)

    def new_with(self, cls: tuple[str, str], names: tuple[str, ...]) -> None:
        """A new object of `cls` with its state dict opened and `names` written."""
        e = self.e
        e.new_with_state(*cls)
        for name in names:
            e.str_(name)

    def sd_item(self, item: tuple[str, tuple[Any, list[Any]]]) -> None:
        """One state_dict_metadata entry: a bytes item's stand-in, or a tensor's with its chunks."""
        e, out = self.e, self.out
        key, (entry, chunks) = item
        e.str_(key)
        if entry is None:
            e.new(_MD, "BytesStorageMetadata")  # no state: no BUILD
            return
        e.new_with_state(_MD, "TensorStorageMetadata")
        e.str_("properties")
        _tensor_properties(e, entry.dtype)
        e.str_("size")
        e.size(entry.shape)
        e.str_("chunks")
        out.extend(pickle.EMPTY_LIST)
        e.put()
        e.batches(chunks, self.chunk, pickle.APPENDS, pickle.APPEND)
        out.extend(_END_STATE)

    def planner_item(self, item: tuple[str, Any]) -> None:
        """One planner_data entry: a key and its path."""
        e = self.e
        e.str_(item[0])
        e.value(item[1])

    def storage_item(self, item: tuple[Any, ...]) -> None:
        """One storage_data entry (MetadataIndex: _StorageInfo): joined from `fast` in the common
        case, else written whole (and `fast` learnt)."""
        e, out, memo, fast = self.e, self.out, self.memo, self.fast
        key, number, box, file, offset, length, transforms = item
        got = fast.get("index")
        n = e.n
        if got is not None and n >= 256 and number is not None and not transforms:
            key_get, file_get = memo.get(id(key)), memo.get(id(file))
            if key_get is not None and file_get is not None:  # the common case, as one join
                offsets, used = _size_tail(box.offsets, n + 2)
                m = n + 2 + used
                out.extend(
                    b"".join(
                        (
                            got,
                            _LONG_PUT(b"r", n),
                            pickle.EMPTY_DICT,
                            _LONG_PUT(b"r", n + 1),
                            pickle.MARK,
                            fast["fqn"],
                            key_get,
                            fast["index_name"],
                            _int(number),
                            fast["offset"],
                            offsets,
                            _END_STATE,
                            fast["info"],
                            _LONG_PUT(b"r", m),
                            pickle.EMPTY_DICT,
                            _LONG_PUT(b"r", m + 1),
                            pickle.MARK,
                            fast["relative_path"],
                            file_get,
                            fast["offset_name"],
                            _int(offset),
                            fast["length"],
                            _int(length),
                            _END_STATE,
                        )
                    )
                )
                e.n = m + 2
                return
        self.storage_item_whole(item)
        names = [
            memo.get(k)
            for k in (
                _INDEX,
                id("fqn"),
                id("index"),
                id("offset"),
                _TORCH_SIZE,
                _INFO,
                id("relative_path"),
                id("length"),
            )
        ]
        if None not in names:
            fast["index"] = names[0] + _NEW
            fast["fqn"], fast["index_name"] = names[1], names[2]
            fast["offset"] = names[3] + names[4]
            fast["info"] = names[5] + _NEW
            fast["relative_path"], fast["offset_name"], fast["length"] = names[6], names[3], names[7]

    def storage_item_whole(self, item: tuple[Any, ...]) -> None:
        """A storage_data entry written opcode by opcode."""
        e, out = self.e, self.out
        key, number, box, file, offset, length, transforms = item
        self.new_with(_INDEX, ("fqn", key, "index"))
        if number is None:
            out.extend(pickle.NONE)
        else:
            out.extend(_int(number))
            e.str_("offset")
            e.size(box.offsets)
        out.extend(_END_STATE)
        self.new_with(_INFO, ("relative_path", file, "offset"))
        out.extend(_int(offset))
        e.str_("length")
        out.extend(_int(length))
        if transforms:
            e.str_("transform_descriptors")
            out.extend(pickle.EMPTY_LIST)
            e.put()
            e.batches(list(transforms), e.str_, pickle.APPENDS, pickle.APPEND)
        out.extend(_END_STATE)


def _tensor_properties(e: _Emitter, dtype: str) -> None:
    """TensorProperties as its __getstate__ pickles it: (dtype, torch.strided, False,
    TORCH_CONTIGUOUS, False), torch.strided and the memory format each written once."""
    out = e.out
    e.new(_MD, "TensorProperties")
    out += pickle.MARK
    e.global_("torch", dtype)
    got = e.memo.get(("strided",))
    if got is None:  # torch.serialization._get_layout("torch.strided")
        e.global_("torch.serialization", "_get_layout")
        e.str_(_STRIDED_NAME)
        out += pickle.TUPLE1
        e.put()
        out += pickle.REDUCE
        e.remember(("strided",))
    else:
        out += got
    out += pickle.NEWFALSE
    got = e.memo.get(("contiguous",))
    if got is None:  # _MEM_FORMAT_ENCODING(0)
        e.global_(_MD, "_MEM_FORMAT_ENCODING")
        out += pickle.BININT1 + b"\x00" + pickle.TUPLE1
        e.put()
        out += pickle.REDUCE
        e.remember(("contiguous",))
    else:
        out += got
    out += pickle.NEWFALSE + pickle.TUPLE
    e.put()
    out += pickle.BUILD
