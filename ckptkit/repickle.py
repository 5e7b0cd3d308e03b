"""Pickling that re-emits inert stand-ins as the classes they stand for.

The restricted unpickler rebuilds foreign objects (DeepSpeed's LossScaler, ZeroStageEnum, DCP
metadata classes, ...) as data-only stand-ins. When ckptkit writes a checkpoint another
framework will load, those objects must come back as the original classes: this pickler writes
a GLOBAL opcode naming the original module and class, followed by the same constructor
arguments (REDUCE) or none (NEWOBJ) and the same state (BUILD) - without importing the foreign
module. torch's small types stand-ins (torch.Size, dtypes, ckptkit.torch_types) are written as
pickle writes the real ones, so writing needs no torch. Tensors go through `persistent_id` like
torch.save's own pickler.
"""

from __future__ import annotations

import gc
import io
import pickle
import struct
from collections import OrderedDict
from typing import Any, Callable

from .safeload import Inert, inert_class, public_state_of, qualname_of
from .torch_types import DType, GlobalRef, Size

__all__ = ["FaithfulPickler", "GlobalRef", "dumps", "fast_dumps", "stand_in", "stand_in_call"]
_TORCH_SIZE = GlobalRef("torch", "Size")


class FaithfulPickler(pickle._Pickler):  # the pure-Python pickler lets us write opcodes directly
    def __init__(
        self,
        file: io.BytesIO,
        protocol: int = 2,
        persistent_id: Callable[[Any], Any] | None = None,
        reduce_hook: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(file, protocol=protocol)
        self._pid = persistent_id
        self._reduce_hook = reduce_hook

    def persistent_id(self, obj: Any) -> Any:  # noqa: D401 - pickle protocol
        return self._pid(obj) if self._pid is not None else None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, GlobalRef):
            self._save_global_ref(obj)
            return
        if isinstance(obj, DType):  # torch.float32 pickles as the global itself
            self._save_global_ref(GlobalRef("torch", obj.attr))
            return
        if type(obj) is Size:  # torch.Size pickles as torch.Size(tuple)
            self._save_memoized_reduce(obj, _TORCH_SIZE, (tuple(obj),))
            return
        if isinstance(obj, Inert):
            self._save_inert(obj)
            return
        if self._reduce_hook is not None and save_persistent_id:
            rv = self._reduce_hook(obj)
            if rv is not None:
                x = self.memo.get(id(obj))
                if x is not None:
                    self.write(self.get(x[0]))
                    return
                self.save_reduce(obj=obj, *rv)
                return
        super().save(obj, save_persistent_id)

    def _save_global_ref(self, ref: GlobalRef) -> None:
        x = self.memo.get(id(ref))  # once per pickle, then a memo reference, as pickle does for globals
        if x is not None:
            self.write(self.get(x[0]))
            return
        self.write(pickle.GLOBAL + f"{ref.module}\n{ref.name}\n".encode("utf-8"))
        self.memoize(ref)

    def _save_memoized_reduce(self, obj: Any, func: GlobalRef, args: tuple) -> None:
        x = self.memo.get(id(obj))
        if x is not None:
            self.write(self.get(x[0]))
            return
        self.save_reduce(func, args, obj=obj)

    def _save_inert(self, obj: Inert) -> None:
        x = self.memo.get(id(obj))
        if x is not None:
            self.write(self.get(x[0]))
            return
        module, _, name = qualname_of(obj).rpartition(".")
        self._save_global_ref(GlobalRef(module, name))
        if "_args" in obj.__dict__:  # built by calling the class (REDUCE), e.g. an Enum member
            self.save(tuple(obj.__dict__["_args"]))
            self.write(pickle.REDUCE)
        else:  # built by cls.__new__(cls) (NEWOBJ), e.g. a plain object or dataclass
            self.save(())
            self.write(pickle.NEWOBJ)
        self.memoize(obj)
        state = obj.__dict__.get("_state", public_state_of(obj))
        if state or "_state" in obj.__dict__:
            self.save(state)
            self.write(pickle.BUILD)


def stand_in(qualname: str, **state: Any) -> Inert:
    """A new object of a foreign class built like a dataclass (NEWOBJ, then BUILD with `state`;
    `_state=x` gives a non-dict state, as a class with __getstate__ pickles it)."""
    cls = inert_class(qualname)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def stand_in_call(qualname: str, *args: Any) -> Inert:
    """A new foreign object pickled as a call (REDUCE): an Enum member, torch's _get_layout(...)."""
    obj = stand_in(qualname)
    obj.__dict__["_args"] = args
    return obj


def dumps(
    obj: Any,
    protocol: int = 2,
    persistent_id: Callable[[Any], Any] | None = None,
    reduce_hook: Callable[[Any], Any] | None = None,
) -> bytes:
    if protocol == 2 and persistent_id is None and reduce_hook is None:
        fast = _fast_dumps(obj)  # DCP's .metadata: a million objects of a few plain types
        if fast is not None:
            return fast
    buf = io.BytesIO()
    FaithfulPickler(buf, protocol, persistent_id, reduce_hook).dump(obj)
    return buf.getvalue()


def fast_dumps(
    obj: Any, persistent_id: Callable[[Any], Any], reduce_hook: Callable[[Any], Any], hooked: tuple[type, ...]
) -> bytes | None:
    """FaithfulPickler's protocol-2 bytes of obj with these hooks, written by the fast writer
    (a torch.save structure of 100k lazy tensors), or None where it declines. `hooked`: the only
    types (exactly) the hooks answer for; they are promised to decline every other object. The
    hooks may have been called before a decline: the caller undoes what they recorded."""
    return _fast_dumps(obj, persistent_id, reduce_hook, hooked)


class _Unsupported(Exception):
    """A value _fast_dumps does not write: FaithfulPickler writes the whole object instead."""


_BINPUT, _LONG_BINPUT, _BINGET, _LONG_BINGET = pickle.BINPUT, pickle.LONG_BINPUT, pickle.BINGET, pickle.LONG_BINGET
_TUPLE_OPS = {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}
_BATCH = pickle._Pickler._BATCHSIZE  # type: ignore[attr-defined]


def _plain_rebuild_args(storage: Any, offset: Any, flag: Any, state: Any, memo: dict, hooked: tuple) -> bool:
    """A tensor rebuild's arguments as _fast_dumps' save_rebuild writes them in one pass: a new
    `hooked` storage (no stand-in), a small int offset, requires_grad False, a new empty OrderedDict."""
    return not (
        type(storage) not in hooked
        or isinstance(storage, (GlobalRef, DType, Size, Inert))
        or id(storage) in memo
        or type(offset) is not int
        or not 0 <= offset <= 0xFF
        or flag is not False
        or type(state) is not OrderedDict
        or state
        or id(state) in memo
        or vars(state)
    )


# Exempt from the 80-line rule: the fast pickle writer emits every opcode inline from local
# variables (one pass over 100k-tensor states); splitting it into calls per value would cost more
# than writing the value.
def _fast_dumps(
    obj: Any,
    persistent_id: Callable[[Any], Any] | None = None,
    reduce_hook: Callable[[Any], Any] | None = None,
    hooked: tuple[type, ...] = (),
) -> bytes | None:
    """FaithfulPickler's protocol-2 bytes for values made only of None, bools, ints, floats, strs,
    tuples, lists, dicts and ckptkit's stand-ins (GlobalRef, DType, Size, Inert), written without
    pickle._Pickler's per-object machinery; None for any other value. It is pickle._Pickler's own
    algorithm step for step (the memo by object identity, what is memoized and when, batches of
    1000, the POP of a tuple that became recursive), so the bytes are the same: tested against
    FaithfulPickler on every fixture's metadata and on generated values. An OrderedDict is written
    as pickle reduces it; an object of a `hooked` type goes to `reduce_hook`, then `persistent_id`,
    in FaithfulPickler's order (the hooks are promised to decline every other object)."""
    out = bytearray(pickle.PROTO + b"\x02")  # (a list of a million small bytes objects would take ~10x the room)
    write = out.extend
    memo: dict[int, int] = {}  # id -> memo index; `held` keeps each object alive, so ids stay unique
    held: list[Any] = []
    class_refs: dict[str, GlobalRef] = {}  # (GlobalRef interns: one object per name, as FaithfulPickler finds)
    pack_b, pack_i, pack_I = struct.Struct("<B").pack, struct.Struct("<i").pack, struct.Struct("<I").pack
    pack_H, pack_d = struct.Struct("<H").pack, struct.Struct(">d").pack

    def get(i: int) -> bytes:
        return _BINGET + pack_b(i) if i < 256 else _LONG_BINGET + pack_I(i)

    def memoize(o: Any) -> None:
        idx = len(memo)
        write(_BINPUT + pack_b(idx) if idx < 256 else _LONG_BINPUT + pack_I(idx))
        memo[id(o)] = idx
        held.append(o)

    def save_global_ref(ref: GlobalRef) -> None:
        x = memo.get(id(ref))
        if x is not None:
            write(get(x))
            return
        write(pickle.GLOBAL + f"{ref.module}\n{ref.name}\n".encode("utf-8"))
        memoize(ref)

    def save_reduce(func: GlobalRef, args: tuple, o: Any) -> None:
        save(func)
        save(args)
        write(pickle.REDUCE)
        x = memo.get(id(o))
        if x is not None:
            write(pickle.POP + get(x))
        else:
            memoize(o)

    def save(o: Any) -> None:  # noqa: C901 - FaithfulPickler.save, then pickle._Pickler.save's dispatch
        t = type(o)
        if t is int:  # the plain types first: none is a stand-in, and ints, floats, bools and None are
            if 0 <= o <= 0xFF:  # never memoized, so their memo lookup always misses
                write(pickle.BININT1 + pack_b(o))
            elif 0 <= o <= 0xFFFF:
                write(pickle.BININT2 + pack_H(o))
            elif -0x80000000 <= o <= 0x7FFFFFFF:
                write(pickle.BININT + pack_i(o))
            else:
                encoded = pickle.encode_long(o)
                n = len(encoded)
                write(pickle.LONG1 + pack_b(n) + encoded if n < 256 else pickle.LONG4 + pack_i(n) + encoded)
            return
        if t is str or t is tuple or t is dict or t is list:  # memoized: looked up first, as pickle does
            x = memo.get(id(o))
            if x is not None:
                write(get(x))
            elif t is str:
                encoded = o.encode("utf-8", "surrogatepass")
                write(pickle.BINUNICODE + pack_I(len(encoded)) + encoded)
                memoize(o)
            elif t is tuple:
                save_tuple(o)
            elif t is dict:
                write(pickle.EMPTY_DICT)
                memoize(o)
                batches(list(o.items()), True)
            else:
                write(pickle.EMPTY_LIST)
                memoize(o)
                batches(o, False)
            return
        if o is None:
            write(pickle.NONE)
            return
        if t is bool:
            write(pickle.NEWTRUE if o else pickle.NEWFALSE)
            return
        if t is float:
            write(pickle.BINFLOAT + pack_d(o))
            return
        if t is GlobalRef or isinstance(o, GlobalRef):
            save_global_ref(o)
            return
        if t is DType or isinstance(o, DType):
            save_global_ref(GlobalRef("torch", o.attr))
            return
        if t is Size:
            x = memo.get(id(o))
            if x is not None:
                write(get(x))
                return
            save_reduce(_TORCH_SIZE, (tuple(o),), o)
            return
        if isinstance(o, Inert):
            save_inert(o)
            return
        if t is OrderedDict:
            save_ordered_dict(o)
            return
        if t in hooked:
            save_hooked(o)
            return
        raise _Unsupported(t)

    def save_ordered_dict(o: OrderedDict) -> None:
        x = memo.get(id(o))
        if x is not None:
            write(get(x))
            return
        if vars(o):  # attributes: pickle adds a BUILD of them
            raise _Unsupported(OrderedDict)
        x = memo.get(id(OrderedDict))  # the class, as pickle's save_global writes it: once, then memo
        if x is not None:
            write(get(x))
        else:
            write(pickle.GLOBAL + b"collections\nOrderedDict\n")
            memoize(OrderedDict)
        write(pickle.EMPTY_TUPLE + pickle.REDUCE)
        memoize(o)
        batches(list(o.items()), True)

    def save_hooked(o: Any) -> None:
        rv = reduce_hook(o) if reduce_hook is not None else None  # called before the memo, as FaithfulPickler does
        if rv is not None:
            x = memo.get(id(o))
            if x is not None:
                write(get(x))
                return
            if (
                len(rv) != 2
                or type(rv[1]) is not tuple
                or getattr(rv[0], "__name__", "") in ("__newobj__", "__newobj_ex__")
            ):
                raise _Unsupported(type(o))
            if not save_rebuild(rv[0], rv[1], o):
                save_reduce(rv[0], rv[1], o)
            return
        pid = persistent_id(o) if persistent_id is not None else None
        if pid is None:
            raise _Unsupported(type(o))
        save(pid)
        write(pickle.BINPERSID)

    def int_tuple(t: Any) -> tuple[bytes, bool] | None:
        """save(t)'s bytes for a tuple of ints (a tensor's size or stride) less its memo PUT, and
        whether the caller writes that PUT (None: not such a tuple)."""
        if type(t) is not tuple:
            return None
        x = memo.get(id(t))
        if x is not None:
            return get(x), False
        n = len(t)
        parts = [pickle.MARK] if n > 3 else []
        for i in t:
            if type(i) is not int:
                return None
            if 0 <= i <= 0xFF:
                parts.append(pickle.BININT1 + pack_b(i))
            elif 0 <= i <= 0xFFFF:
                parts.append(pickle.BININT2 + pack_H(i))
            elif -0x80000000 <= i <= 0x7FFFFFFF:
                parts.append(pickle.BININT + pack_i(i))
            else:
                return None
        parts.append(pickle.EMPTY_TUPLE if n == 0 else _TUPLE_OPS[n] if n <= 3 else pickle.TUPLE)
        return b"".join(parts), n > 0

    def save_rebuild(func: Any, args: tuple, o: Any) -> bool:
        """save_reduce(func, args, o) in one pass for torch's tensor rebuild, the one reduction a
        torch.save structure repeats per tensor: args (storage, offset, size, stride, False, an
        empty OrderedDict[, dtype]), the storage a `hooked` object written by persistent_id as
        (str, GlobalRef, str, str, int), every global and repeated string already in the memo,
        the args, the storage's tuple and the OrderedDict new (size and stride may repeat). Exactly the opcodes and
        memo entries of the general
        path; False, with nothing written, for anything else (the general path then writes it;
        the hooks may have been asked about the storage: they decline it both times)."""
        n = len(args)
        if n != 6 and n != 7 or type(func) is not GlobalRef or id(args) in memo:
            return False
        storage, offset, size, stride, flag, state = args[:6]
        f = memo.get(id(func))
        od = memo.get(id(OrderedDict))
        if f is None or od is None or not _plain_rebuild_args(storage, offset, flag, state, memo, hooked):
            return False
        dtype_ref = None
        if n == 7:
            if type(args[6]) is not DType:
                return False
            dtype_ref = memo.get(id(GlobalRef("torch", args[6].attr)))
            if dtype_ref is None:
                return False
        sized, strided = int_tuple(size), int_tuple(stride)
        if sized is None or strided is None or (size is stride and sized[1]):
            return False
        if reduce_hook is not None and reduce_hook(storage) is not None:
            return False
        pid = persistent_id(storage) if persistent_id is not None else None
        if type(pid) is not tuple or len(pid) != 5 or id(pid) in memo:
            return False
        tag, cls, key, device, numel = pid
        got = memo.get
        tag_at, cls_at, device_at = got(id(tag)), got(id(cls)), got(id(device))
        if (
            type(tag) is not str
            or tag_at is None
            or type(cls) is not GlobalRef
            or cls_at is None
            or type(key) is not str
            or type(device) is not str
            or device_at is None
            or type(numel) is not int
        ):
            return False
        key_at = got(id(key))
        write(get(f) + pickle.MARK + pickle.MARK + get(tag_at) + get(cls_at))
        if key_at is not None:
            write(get(key_at))
        else:
            encoded = key.encode("utf-8", "surrogatepass")
            write(pickle.BINUNICODE + pack_I(len(encoded)) + encoded)
            memoize(key)
        write(get(device_at))
        save(numel)
        write(pickle.TUPLE)
        memoize(pid)
        write(pickle.BINPERSID + pickle.BININT1 + pack_b(offset) + sized[0])
        if sized[1]:
            memoize(size)
        write(strided[0])
        if strided[1]:
            memoize(stride)
        write(pickle.NEWFALSE + get(od) + pickle.EMPTY_TUPLE + pickle.REDUCE)
        memoize(state)
        if dtype_ref is not None:
            write(get(dtype_ref))
        write(pickle.TUPLE)
        memoize(args)
        write(pickle.REDUCE)
        memoize(o)
        return True

    def save_tuple(o: tuple) -> None:
        if not o:
            write(pickle.EMPTY_TUPLE)
            return
        n = len(o)
        if n > 3:
            write(pickle.MARK)
        for element in o:
            save(element)
        x = memo.get(id(o))
        if x is not None:  # saving an element memoized this very tuple (a recursive tuple)
            write((pickle.POP * n if n <= 3 else pickle.POP_MARK) + get(x))
            return
        write(_TUPLE_OPS[n] if n <= 3 else pickle.TUPLE)
        memoize(o)

    def batches(items: Any, pairs: bool) -> None:
        items = list(items)
        for start in range(0, len(items), _BATCH):
            batch = items[start : start + _BATCH]
            if len(batch) > 1:
                write(pickle.MARK)
                for item in batch:
                    if pairs:
                        save(item[0])
                        save(item[1])
                    else:
                        save(item)
                write(pickle.SETITEMS if pairs else pickle.APPENDS)
            else:
                if pairs:
                    save(batch[0][0])
                    save(batch[0][1])
                else:
                    save(batch[0])
                write(pickle.SETITEM if pairs else pickle.APPEND)

    def save_inert(o: Inert) -> None:
        x = memo.get(id(o))
        if x is not None:
            write(get(x))
            return
        qualname = qualname_of(o)
        ref = class_refs.get(qualname)
        if ref is None:
            module, _, name = qualname.rpartition(".")
            ref = class_refs[qualname] = GlobalRef(module, name)
        save_global_ref(ref)
        if "_args" in o.__dict__:
            save(tuple(o.__dict__["_args"]))
            write(pickle.REDUCE)
        else:
            write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)  # save(()): the empty tuple is never memoized
        memoize(o)
        state = o.__dict__.get("_state", public_state_of(o))
        if state or "_state" in o.__dict__:
            save(state)
            write(pickle.BUILD)

    collecting = gc.isenabled()
    if collecting:
        gc.disable()  # a million new objects held by the memo, none in a cycle: the collector only costs time
    try:
        save(obj)
    except (_Unsupported, RecursionError):
        return None
    finally:
        if collecting:
            gc.enable()
    write(pickle.STOP)
    return bytes(out)
