"""The pickle machine behind ckptkit's restricted unpickler: it accepts DATA ONLY, within limits.

Python's own unpickler lets a pickle call anything it names and run any object's __setstate__;
its C implementation cannot be hooked per opcode. This machine executes the opcodes itself, from
bytes in memory, so that every step is checked before it allocates or calls:

- globals resolve through the grammar (find_class); only callables the grammar lists are called
  (REDUCE, NEWOBJ, NEWOBJ_EX), each with argument types it checks; BUILD goes to the grammar too,
  which allows it on ckptkit's own stand-ins only; INST, OBJ, extension codes and out-of-band
  buffers are refused;
- declared lengths are checked against the bytes left before anything is sliced;
- objects (containers, strings, rebuilt values, memo entries) are counted; every value on the
  stack carries its nesting depth; the expanded size (the values a walk of the result visits, a
  shared sub-object counted each time it is reached) is bounded: beyond the values the pickle
  writes out itself, every memo GET of a container adds the size of that container (computed
  once per object). A container fetched from the memo is sealed: changing it afterwards is
  refused, so a size once computed stays true, and no value can contain itself;
- the result is therefore acyclic, so Python's cycle collector is paused while the machine runs.

Any limit hit is a FormatError naming the limit; anything outside the grammar an UnsafePickleError.
The caller (safeload.restricted_loads) prefixes the file's name.
"""

from __future__ import annotations

import codecs
import gc
import struct
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any, Protocol

from .. import knobs
from ..errors import FormatError, UnsafePickleError
from .rules import pickle_account


class Placeholder:
    """A value a rebuild function returns that only the BUILD after it completes (numpy's dtype and
    ndarray pickle as a call plus a state): the grammar's build returns the finished value, which
    replaces the placeholder on the stack and wherever it was memoized. A placeholder used before
    its BUILD, or never built, is refused."""

    __slots__ = ()


class Grammar(Protocol):
    """What the machine asks about globals and calls; see safeload.grammar for ckptkit's."""

    def find_class(self, module: str, name: str) -> Any: ...

    def call(self, func: Any, args: tuple) -> Any: ...

    def new(self, cls: Any, args: tuple, kwargs: dict | None) -> Any: ...

    def build(self, obj: Any, state: Any) -> Any: ...

    def persistent_load(self, pid: Any) -> Any: ...

    def cost(self, value: Any) -> tuple[int, int]:
        """What a rebuilt value adds beyond its inputs: (expanded size, bytes built)."""

    def children(self, value: Any) -> Any:
        """The values inside a rebuilt value (for its expanded size), or None for a leaf."""


@dataclass(frozen=True)
class Limits:
    """The bounds one pickle is held to (defaults: ckptkit.knobs when made, read from the
    environment when first used, never at import)."""

    objects: int = field(default_factory=lambda: knobs.MAX_PICKLE_OBJECTS)
    depth: int = field(default_factory=lambda: knobs.MAX_PICKLE_DEPTH)
    expanded: int = field(default_factory=lambda: knobs.MAX_PICKLE_EXPANDED)
    blob: int = field(default_factory=lambda: knobs.MAX_PICKLE_BLOB)
    built: int = field(default_factory=lambda: knobs.MAX_PICKLE_BUILT)
    seconds: float = field(default_factory=lambda: knobs.MAX_PICKLE_SECONDS)

    @classmethod
    def current(cls) -> "Limits":
        """The knobs' values now (tests and callers may change them at run time)."""
        return cls(
            knobs.MAX_PICKLE_OBJECTS,
            knobs.MAX_PICKLE_DEPTH,
            knobs.MAX_PICKLE_EXPANDED,
            knobs.MAX_PICKLE_BLOB,
            knobs.MAX_PICKLE_BUILT,
            knobs.MAX_PICKLE_SECONDS,
        )


_I = struct.Struct("<I").unpack_from
_i = struct.Struct("<i").unpack_from
_H = struct.Struct("<H").unpack_from
_Q = struct.Struct("<Q").unpack_from
_D = struct.Struct(">d").unpack_from

MAX_INT_BYTES = 128  # LONG1 / LONG4: Python ints of more than 1024 bits are no checkpoint's data
MAX_TEXT_LINE = 512  # INT / LONG / FLOAT / GET / PUT arguments of protocol 0
EXPANDED_PER_BYTE = 4  # the expanded-size limit of a large pickle: this many values per input byte
MAX_SAME_HASH = 64  # keys of one set sharing one hash: more are crafted (each insert walks them all)
OBJECT_BYTES = 64  # what one object costs the memory account at least (an empty dict: 64 bytes)

# values with nothing inside them whose expanded size is 1 (text and bytes weigh by length)
_ATOMS = frozenset({int, float, bool, type(None), complex, type, FunctionType, slice})

_REFUSED_OPS = {
    ord("i"): "INST",
    ord("o"): "OBJ",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
}

_EXPANDED = "expands to more values than allowed when shared parts are counted each time they are reached"


class _Stop(Exception):
    pass


def _limit(what: str, value: float, knob: str) -> FormatError:
    return FormatError(f"pickle {what} (limit {value:,}, ckptkit.knobs.{knob})")


def check_keys(keys: list) -> None:
    """Keys about to go into a set or dict in one step: hashable, and not crafted to share one hash."""
    try:
        if len(keys) <= MAX_SAME_HASH:
            for k in keys:
                hash(k)
            return
        counts = Counter(map(hash, keys))
    except TypeError:
        raise FormatError("pickle uses an unhashable value as a set item or dictionary key") from None
    if max(counts.values()) > MAX_SAME_HASH:
        raise FormatError(
            f"pickle puts more than {MAX_SAME_HASH} keys with one hash value into one set or "
            f"dictionary (keys crafted to collide)"
        )


class Machine:
    """One run over one pickle's bytes."""

    def __init__(self, data: bytes, grammar: Grammar, limits: Limits | None = None) -> None:
        self.data = data if type(data) is bytes else bytes(data)
        self.grammar = grammar
        self.limits = lim = limits or Limits.current()
        # a large pickle may hold more: objects never outnumber opcodes, so a quarter of its bytes
        # (a real .metadata creates one object per 4.5 bytes) costs no more than reading it
        # ... and both, with the bytes rebuilt, within the one account of the memory budget
        # (max(budget, 2 x the pickle): docs/reliability.md), OBJECT_BYTES an object at least
        self.account = pickle_account(len(self.data))
        self.max_objects = min(max(lim.objects, len(self.data) // 4), max(1, self.account // OBJECT_BYTES))
        # likewise the expanded size: a walk of the result costs at most a few steps per input byte,
        # so a 500k-tensor .metadata (which shares its dtypes and properties) is read, while a 1.5 KB
        # pickle of lists sharing their children (2**40 when walked) is refused
        self.max_expanded = max(lim.expanded, EXPANDED_PER_BYTE * len(self.data))
        self.stack: list[Any] = []
        self.depths: list[int] = []  # the nesting depth of each value on the stack
        self.marks: list[int] = [0]  # stack heights at each MARK (0: the bottom)
        self.memo: list[Any] = []  # memo entries 0, 1, 2 ... (what picklers write)
        self.memo_far: dict[int, Any] = {}  # entries put past the end of `memo` (only crafted pickles)
        self.objects = 0  # containers and rebuilt values created (memo entries aside)
        self.extra = 0  # expanded size added by memo GETs and rebuilds
        self.built = 0  # bytes rebuild calls created
        self.sealed: set[int] = set()  # ids of values fetched from the memo (never changed again)
        self.sizes: dict[int, tuple[int, int]] = {}  # id -> (expanded size, depth), computed once
        self.keep: list[Any] = []  # what `sealed` and `sizes` name, kept alive
        self.pending: dict[int, list] = {}  # id(placeholder) -> [placeholder, memo keys]
        self.pos = 0
        self.costly: dict[type, bool] = {}  # per type: may a value of it cost more than its inputs
        self.atoms = _ATOMS | frozenset(getattr(grammar, "atoms", ()))
        self.seconds = lim.seconds + len(self.data) / 1e6
        self.deadline = time.monotonic() + self.seconds

    # ---- bookkeeping ------------------------------------------------------------------------

    def tick(self) -> None:
        """The last line against work that grows faster than the input (colliding dict keys)."""
        if time.monotonic() > self.deadline:
            raise FormatError(
                f"pickle takes longer than {self.seconds:.0f} s to read (limit "
                f"ckptkit.knobs.MAX_PICKLE_SECONDS plus one second per MB)"
            )

    def count(self, n: int = 1) -> None:
        self.objects += n
        if self.objects + self.memo_size() > self.max_objects:
            raise self.too_many()

    def too_many(self) -> FormatError:
        if self.max_objects * OBJECT_BYTES >= self.account:
            return FormatError(
                f"pickle creates more objects than the memory budget allows (limit "
                f"{self.max_objects:,}; raise --memory-budget or {knobs.MEMORY_BUDGET_ENV})"
            )
        return _limit("creates more objects than allowed", self.max_objects, "MAX_PICKLE_OBJECTS")

    def spend(self, built: int) -> None:
        """Bytes a rebuild call created: within MAX_PICKLE_BUILT and, with the objects, the account."""
        self.built += built
        if self.built > self.limits.built:
            raise _limit("rebuilds more bytes than allowed", self.limits.built, "MAX_PICKLE_BUILT")
        if self.built + (self.objects + self.memo_size()) * OBJECT_BYTES > self.account:
            raise FormatError(
                f"pickle rebuilds more bytes than the memory budget allows ({self.built:,} bytes "
                f"besides its objects; raise --memory-budget or {knobs.MEMORY_BUDGET_ENV})"
            )

    def memo_size(self) -> int:
        return len(self.memo) + len(self.memo_far)

    def too_deep(self) -> FormatError:
        return _limit("is nested deeper than allowed", self.limits.depth, "MAX_PICKLE_DEPTH")

    def add_extra(self, n: int) -> None:
        self.extra += n
        if self.extra > self.max_expanded:
            raise _limit(_EXPANDED, self.max_expanded, "MAX_PICKLE_EXPANDED")

    def size_of(self, root: Any) -> tuple[int, int]:
        """(expanded size, depth) of a value, walking it once (iteratively) and remembering
        every object inside; shared objects count each time they are reached."""
        sizes = self.sizes
        got = sizes.get(id(root))
        if got is not None:
            return got
        limit = self.max_expanded + len(self.data)
        children_of = self.grammar.children
        todo: list[tuple[Any, bool]] = [(root, False)]
        walking: set[int] = set()
        while todo:
            value, done = todo.pop()
            key = id(value)
            if key in sizes:
                continue
            kids = _children(value, children_of)
            if not kids:
                sizes[key] = (_leaf_weight(value, self.grammar), 0)
                continue
            if not done:
                todo.append((value, True))
                if key in walking:
                    raise FormatError("pickle builds a value that contains itself")
                walking.add(key)
                todo.extend((k, False) for k in kids if id(k) not in sizes)
                continue
            walking.discard(key)
            weight, depth = 1, 0
            for k in kids:
                got = sizes.get(id(k))
                if got is None:  # a value met twice on the way down: in the middle of its own walk
                    raise FormatError("pickle builds a value that contains itself")
                weight += got[0]
                if got[1] >= depth:
                    depth = got[1] + 1
            if weight > limit:
                raise _limit(_EXPANDED, limit, "MAX_PICKLE_EXPANDED")
            sizes[key] = (weight, depth)
        self.keep.append(root)
        return sizes[id(root)]

    def shared(self, value: Any) -> int:
        """A value fetched from the memo (GET) or duplicated: seal it, add its size; its depth."""
        key = id(value)
        if key not in self.sealed:
            self.sealed.add(key)
            self.keep.append(value)
        weight, depth = self.size_of(value)
        self.add_extra(weight)
        return depth

    def blob(self, pos: int, n: int, what: str) -> None:
        """A byte string or text of n bytes starts at `pos`: within the input and the cap."""
        if n > len(self.data) - pos:
            raise FormatError(
                f"pickle declares a {what} of {n:,} bytes at byte {pos}, past the end of its {len(self.data):,} bytes"
            )
        if n > self.limits.blob:
            raise _limit(f"holds a {what} of {n:,} bytes, more than allowed", self.limits.blob, "MAX_PICKLE_BLOB")

    def pop_mark(self) -> tuple[list, list]:
        marks = self.marks
        if len(marks) == 1:
            raise FormatError("pickle uses a MARK it never set")
        k = marks.pop()
        items = self.stack[k:]
        depths = self.depths[k:]
        del self.stack[k:]
        del self.depths[k:]
        return items, depths

    def pop(self) -> tuple[Any, int]:
        if len(self.stack) <= self.marks[-1]:
            raise FormatError("pickle takes a value from an empty stack")
        return self.stack.pop(), self.depths.pop()

    def need(self, n: int) -> None:
        if len(self.stack) - n < self.marks[-1]:
            raise FormatError("pickle takes a value from an empty stack")

    def memo_put(self, key: int, value: Any) -> None:
        """PUT: the last value put at a key is the one GET finds (entries past the end of the
        list wait in memo_far until the list reaches them, and are then shadowed)."""
        memo = self.memo
        if key < len(memo):
            memo[key] = value
        elif key == len(memo):
            memo.append(value)
        else:
            self.memo_far[key] = value
        if self.objects + self.memo_size() > self.max_objects:
            raise self.too_many()
        if self.pending:
            p = self.pending.get(id(value))
            if p is not None:
                p[1].append(key)

    def memo_get(self, key: int) -> Any:
        if key < len(self.memo):
            return self.memo[key]
        try:
            return self.memo_far[key]
        except KeyError:
            raise FormatError(f"pickle refers to memo entry {key}, which it never stored") from None

    def get(self, key: int) -> None:
        self.push_shared(self.memo_get(key))

    def push_shared(self, value: Any) -> None:
        t = type(value)
        if t is str or t is bytes:
            if len(value) >= 64:
                self.add_extra(len(value) >> 6)
            depth = 0
        elif t in self.atoms:
            depth = 0
        else:
            depth = self.shared(value)
        self.stack.append(value)
        self.depths.append(depth)

    def charge(self, value: Any) -> None:
        """A rebuilt value that may cost more than its inputs (bytes built, a range's length) or
        that only a BUILD completes (a placeholder)."""
        extra, built = self.grammar.cost(value)
        if built:
            self.spend(built)
            extra += built >> 6
        if extra:
            self.add_extra(extra)
        if isinstance(value, Placeholder):
            self.pending[id(value)] = [value, []]
            self.keep.append(value)

    def push_built(self, value: Any, depth: int) -> None:
        """A rebuilt value from inputs of `depth`: counted, its cost charged, pushed."""
        if depth >= self.limits.depth:
            raise self.too_deep()
        self.count()
        self.charge(value)
        self.stack.append(value)
        self.depths.append(depth + 1)

    def do_newobj(self, with_kwargs: bool) -> None:
        kwargs, kdepth = self.pop() if with_kwargs else (None, 0)
        args, depth = self.pop()
        self.need(1)
        cls = self.stack.pop()
        self.depths.pop()
        if type(args) is not tuple or (kwargs is not None and type(kwargs) is not dict):
            raise FormatError("pickle creates an object with malformed arguments")
        self.push_built(self.grammar.new(cls, args, kwargs), max(depth, kdepth))

    def build_pending(self, obj: Any, state: Any) -> None:
        """BUILD completing a placeholder: the finished value replaces it on the stack and in the memo."""
        p = self.pending.pop(id(obj))
        value = self.grammar.build(obj, state)
        extra, built = self.grammar.cost(value)
        if built:
            self.spend(built)
            extra += built >> 6
        if extra:
            self.add_extra(extra)
        self.stack[-1] = value
        for key in p[1]:
            if self.memo_get(key) is obj:
                self.memo_put(key, value)

    def do_global(self, module: Any, name: Any) -> None:
        if type(module) is not str or type(name) is not str:
            raise FormatError("pickle names a global with something other than text")
        self.stack.append(self.grammar.find_class(module, name))
        self.depths.append(0)

    def do_persistent(self, pid: Any, depth: int) -> None:
        self.push_built(self.grammar.persistent_load(pid), depth)

    def grow(self, target: Any, depths: list, kind: type | tuple) -> None:
        """`target` (the stack's top) is about to receive items of `depths`."""
        if type(target) is not kind and not (type(kind) is tuple and type(target) in kind):
            raise FormatError(f"pickle stores items into a {type(target).__name__}")
        if id(target) in self.sealed:
            raise FormatError(
                f"pickle changes a {type(target).__name__} after it was shared (or makes it contain itself)"
            )
        if depths:
            d = max(depths) + 1
            if d > self.depths[-1]:
                if d > self.limits.depth:
                    raise self.too_deep()
                self.depths[-1] = d

    def set_items(self, target: dict, items: list) -> None:
        """Store key/value pairs, watching the clock (colliding keys make each store slower)."""
        self.tick()
        try:
            for start in range(0, len(items), 2048):
                if start:
                    self.tick()
                for i in range(start, min(start + 2048, len(items)), 2):
                    target[items[i]] = items[i + 1]
        except TypeError:
            raise FormatError("pickle uses an unhashable value as a dictionary key") from None

    def new_container(self, value: Any, depths: list) -> None:
        d = max(depths) + 1 if depths else 1
        if d > self.limits.depth:
            raise self.too_deep()
        self.count()
        self.stack.append(value)
        self.depths.append(d)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> Any:
        """Execute the pickle; the value STOP returns."""
        collecting = gc.isenabled()
        if collecting:
            gc.disable()  # millions of new containers, none in a cycle: the collector only costs time
        try:
            self._loop()
        except _Stop:
            pass
        except (IndexError, struct.error):
            raise FormatError("pickle is truncated (or an opcode's argument runs past its end)") from None
        except UnicodeDecodeError:  # the text opcodes decode in the hot loop: checked here, once
            raise FormatError("pickle holds text that is not UTF-8") from None
        finally:
            if collecting:
                gc.enable()
        if self.pending:
            raise FormatError("pickle rebuilds a value (a numpy array or dtype) without its state")
        return self.stack[-1]

    def _loop(self) -> None:  # noqa: C901 - one opcode per branch, the hottest first
        """The hot opcodes inline; the rest in `rare`. A stack underflow below a MARK is not
        checked here (the values are only data); an empty stack raises IndexError (truncated)."""
        data = self.data
        n = len(data)
        stack = self.stack
        push = stack.append
        depths = self.depths
        dpush = depths.append
        memo = self.memo
        marks = self.marks
        lim = self.limits
        max_objects = self.max_objects
        max_depth = lim.depth
        atoms = self.atoms
        sealed = self.sealed
        pending = self.pending
        costly = self.costly
        grammar = self.grammar
        new = grammar.new
        call = grammar.call
        build = grammar.build
        nobj = 0
        pos = 0
        while True:
            op = data[pos]
            pos += 1
            if op == 0x94:  # MEMOIZE
                value = stack[-1]
                k = len(memo)
                memo.append(value)
                if k + nobj >= max_objects:
                    self.objects += nobj
                    self.count(0)
                if pending and id(value) in pending:
                    pending[id(value)][1].append(k)
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                if op == 0x68:
                    key = data[pos]
                    pos += 1
                else:
                    key = _I(data, pos)[0]
                    pos += 4
                if key >= len(memo):
                    self.get(key)
                    continue
                value = memo[key]
                t = type(value)
                if t in atoms:
                    push(value)
                    dpush(0)
                elif t is str and len(value) < 64:
                    push(value)
                    dpush(0)
                else:
                    self.push_shared(value)
            elif op == 0x4B:  # BININT1
                push(data[pos])
                dpush(0)
                pos += 1
            elif op == 0x28:  # MARK
                if len(marks) > max_depth:
                    raise self.too_deep()
                marks.append(len(stack))
            elif op == 0x29:  # EMPTY_TUPLE
                push(())
                dpush(0)
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                d = depths.pop()
                cls = stack[-1]
                if type(args) is not tuple:
                    raise FormatError("pickle creates an object with malformed arguments")
                value = new(cls, args, None)
                if d >= max_depth:
                    raise self.too_deep()
                stack[-1] = value
                depths[-1] = d + 1
                nobj += 1
                if nobj > max_objects:
                    self.objects += nobj
                    self.count(0)
                t = type(value)
                c = costly.get(t)
                if c is None:
                    c = costly[t] = grammar.is_costly(t)
                if c:
                    self.pos = pos
                    self.charge(value)
            elif op == 0x62:  # BUILD
                state = stack.pop()
                d = depths.pop() + 1
                obj = stack[-1]
                if id(obj) in sealed:
                    raise FormatError(
                        f"pickle sets the state of a {type(obj).__name__} after it was shared "
                        f"(or makes it contain itself)"
                    )
                if pending and id(obj) in pending:
                    self.build_pending(obj, state)
                elif build(obj, state) is not obj:
                    raise UnsafePickleError(f"refusing to replace a {type(obj).__name__} by setting its state")
                if d > depths[-1]:
                    if d > max_depth:
                        raise self.too_deep()
                    depths[-1] = d
            elif op == 0x86:  # TUPLE2
                value = (stack[-2], stack[-1])
                d = depths[-2]
                if depths[-1] > d:
                    d = depths[-1]
                if d >= max_depth:
                    raise self.too_deep()
                del stack[-1]
                del depths[-1]
                stack[-1] = value
                depths[-1] = d + 1
                nobj += 1
            elif op == 0x75:  # SETITEMS
                if len(marks) == 1:
                    raise FormatError("pickle uses a MARK it never set")
                k = marks.pop()
                items = stack[k:]
                ds = depths[k:]
                del stack[k:]
                del depths[k:]
                target = stack[-1]
                t = type(target)
                if (
                    (t is not dict and t is not OrderedDict)
                    or id(target) in sealed
                    or len(items) % 2
                    or len(items) > 4096
                ):
                    self.grow(target, ds, (dict, OrderedDict))  # refuses, or a long batch
                    if len(items) % 2:
                        raise FormatError("pickle sets dictionary items from an odd number of values")
                    self.set_items(target, items)
                elif items:
                    d = max(ds) + 1
                    if d > depths[-1]:
                        if d > max_depth:
                            raise self.too_deep()
                        depths[-1] = d
                    try:
                        target.update(zip(items[::2], items[1::2]))
                    except TypeError:
                        raise FormatError("pickle uses an unhashable value as a dictionary key") from None
                    if time.monotonic() > self.deadline:
                        self.tick()
            elif op == 0x7D or op == 0x5D:  # EMPTY_DICT, EMPTY_LIST
                push({} if op == 0x7D else [])
                dpush(1)
                nobj += 1
                if nobj > max_objects:
                    self.objects += nobj
                    self.count(0)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                d = depths.pop()
                if type(args) is not tuple:
                    raise FormatError(f"pickle calls a global with {type(args).__name__} arguments, not a tuple")
                value = call(stack[-1], args)
                if d >= max_depth:
                    raise self.too_deep()
                stack[-1] = value
                depths[-1] = d + 1
                nobj += 1
                if nobj > max_objects:
                    self.objects += nobj
                    self.count(0)
                t = type(value)
                c = costly.get(t)
                if c is None:
                    c = costly[t] = grammar.is_costly(t)
                if c:
                    self.pos = pos
                    self.charge(value)
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
                d = depths[-1] + 1
                if d > max_depth:
                    raise self.too_deep()
                depths[-1] = d
                nobj += 1
                if nobj > max_objects:
                    self.objects += nobj
                    self.count(0)
            elif op == 0x8C:  # SHORT_BINUNICODE
                k = data[pos]
                pos += 1
                end = pos + k
                if end > n:
                    self.blob(pos, k, "text")
                push(str(data[pos:end], "utf-8", "surrogatepass"))
                dpush(0)
                pos = end
                nobj += 1
            elif op == 0x89:  # NEWFALSE
                push(False)
                dpush(0)
            elif op == 0x4D:  # BININT2
                push(_H(data, pos)[0])
                dpush(0)
                pos += 2
            elif op == 0x74:  # TUPLE
                items, ds = self.pop_mark()
                self.new_container(tuple(items), ds)
            elif op == 0x61 or op == 0x65:  # APPEND, APPENDS
                if op == 0x61:
                    items = [stack.pop()]
                    ds = [depths.pop()]
                else:
                    items, ds = self.pop_mark()
                target = stack[-1]
                if type(target) is not list or id(target) in sealed:
                    self.grow(target, ds, list)  # refuses
                if ds:
                    d = max(ds) + 1
                    if d > depths[-1]:
                        if d > max_depth:
                            raise self.too_deep()
                        depths[-1] = d
                target.extend(items)
            elif op == 0x4A:  # BININT
                push(_i(data, pos)[0])
                dpush(0)
                pos += 4
            elif op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
                if op == 0x71:
                    key = data[pos]
                    pos += 1
                else:
                    key = _I(data, pos)[0]
                    pos += 4
                if key == len(memo):
                    value = stack[-1]
                    memo.append(value)
                    if key + nobj >= max_objects:
                        self.objects += nobj
                        self.count(0)
                    if pending and id(value) in pending:
                        pending[id(value)][1].append(key)
                else:
                    self.objects += nobj
                    nobj = 0
                    self.memo_put(key, stack[-1])
            elif op == 0x4E:  # NONE
                push(None)
                dpush(0)
            elif op == 0x88:  # NEWTRUE
                push(True)
                dpush(0)
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                module = stack.pop()
                del depths[-2:]
                self.do_global(module, name)
            elif op == 0x87:  # TUPLE3
                items = stack[-3:]
                ds = depths[-3:]
                if len(items) < 3:
                    raise FormatError("pickle takes a value from an empty stack")
                del stack[-3:]
                del depths[-3:]
                self.new_container(tuple(items), ds)
            elif op == 0x58:  # BINUNICODE
                k = _I(data, pos)[0]
                pos += 4
                self.blob(pos, k, "text")
                push(str(data[pos : pos + k], "utf-8", "surrogatepass"))
                dpush(0)
                pos += k
                nobj += 1
            elif op == 0x2E:  # STOP
                self.objects += nobj
                if not stack:
                    raise FormatError("pickle stops with nothing to return")
                raise _Stop
            elif op == 0x95:  # FRAME
                k = _Q(data, pos)[0]
                pos += 8
                if k > n - pos:
                    raise FormatError(
                        f"pickle declares a frame of {k:,} bytes at byte {pos - 9}, past the end of its {n:,} bytes"
                    )
            else:
                self.objects += nobj
                nobj = 0
                pos = self.rare(op, pos)

    def rare(self, op: int, pos: int) -> int:  # noqa: C901 - the opcodes real checkpoints seldom use
        """Execute one of the less frequent opcodes whose argument starts at `pos`; the next position."""
        data = self.data
        stack = self.stack
        self.pos = pos
        if op == 0x80:  # PROTO
            if data[pos] > 5:
                raise FormatError(f"pickle protocol {data[pos]} is not supported")
            return pos + 1
        if op == 0x47:  # BINFLOAT
            self.stack.append(_D(data, pos)[0])
            self.depths.append(0)
            return pos + 8
        if op in (0x43, 0x42, 0x8E, 0x96):  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
            width = {0x43: 1, 0x42: 4, 0x8E: 8, 0x96: 8}[op]
            k = data[pos] if width == 1 else (_I(data, pos)[0] if width == 4 else _Q(data, pos)[0])
            pos += width
            self.blob(pos, k, "byte string")
            value: Any = data[pos : pos + k]
            if op == 0x96:
                value = bytearray(value)
                self.count()
            stack.append(value)
            self.depths.append(0)
            return pos + k
        if op == 0x8D:  # BINUNICODE8
            k = _Q(data, pos)[0]
            pos += 8
            self.blob(pos, k, "text")
            stack.append(str(data[pos : pos + k], "utf-8", "surrogatepass"))
            self.depths.append(0)
            return pos + k
        if op in (0x8A, 0x8B):  # LONG1, LONG4
            k = data[pos] if op == 0x8A else _i(data, pos)[0]
            pos += 1 if op == 0x8A else 4
            if k < 0 or k > MAX_INT_BYTES:
                raise FormatError(
                    f"pickle holds an integer of {k} bytes at byte {pos}; at most {MAX_INT_BYTES} are expected"
                )
            self.blob(pos, k, "integer")
            stack.append(int.from_bytes(data[pos : pos + k], "little", signed=True))
            self.depths.append(0)
            return pos + k
        if op == 0x51:  # BINPERSID
            pid, depth = self.pop()
            self.do_persistent(pid, depth)
            return pos
        if op == 0x92:  # NEWOBJ_EX
            self.do_newobj(True)
            return pos
        if op == 0x73:  # SETITEM
            value, d = self.pop()
            key, kd = self.pop()
            self.need(1)
            target = stack[-1]
            self.grow(target, [d, kd], (dict, OrderedDict))
            self.set_items(target, [key, value])
            return pos
        if op == 0x8F:  # EMPTY_SET
            self.new_container(set(), [])
            return pos
        if op == 0x90:  # ADDITEMS
            items, ds = self.pop_mark()
            self.need(1)
            target = stack[-1]
            self.grow(target, ds, set)
            check_keys(items)
            self.tick()
            target.update(items)
            return pos
        if op == 0x91:  # FROZENSET
            items, ds = self.pop_mark()
            check_keys(items)
            self.new_container(frozenset(items), ds)
            return pos
        if op == 0x6C:  # LIST
            items, ds = self.pop_mark()
            self.new_container(items, ds)
            return pos
        if op == 0x64:  # DICT
            items, ds = self.pop_mark()
            if len(items) % 2:
                raise FormatError("pickle builds a dictionary from an odd number of values")
            value: dict = {}
            self.new_container(value, ds)
            self.set_items(value, items)
            return pos
        if op == 0x30:  # POP
            if len(stack) > self.marks[-1]:
                self.pop()
            else:
                self.pop_mark()
            return pos
        if op == 0x31:  # POP_MARK
            self.pop_mark()
            return pos
        if op == 0x32:  # DUP
            self.need(1)
            self.push_shared(stack[-1])
            return pos
        if op == 0x68 or op == 0x6A:  # (BINGET / LONG_BINGET of a missing entry)
            raise FormatError("pickle refers to a memo entry it never stored")
        if op in (0x67, 0x70, 0x49, 0x4C, 0x46):  # GET, PUT, INT, LONG, FLOAT (protocol 0)
            line = self.line(pos)
            pos = self.pos
            if len(line) > MAX_TEXT_LINE:
                raise FormatError(f"pickle has a number of {len(line)} characters near byte {pos}")
            try:
                if op == 0x46:
                    value = float(line)
                elif op == 0x49 and line in (b"00", b"01"):
                    value = line == b"01"
                else:
                    value = int(
                        line[:-1] if op == 0x4C and line.endswith(b"L") else line,
                        0 if op != 0x67 and op != 0x70 else 10,
                    )
            except ValueError:
                raise FormatError(f"pickle has a malformed number near byte {pos}") from None
            if op == 0x67:
                self.get(value)
            elif op == 0x70:
                if value < 0:
                    raise FormatError("pickle has a negative memo index")
                if len(stack) <= self.marks[-1]:
                    raise FormatError("pickle memoizes from an empty stack")
                self.memo_put(value, stack[-1])
            else:
                stack.append(value)
                self.depths.append(0)
            return pos
        if op in (0x53, 0x54, 0x55, 0x56):  # STRING, BINSTRING, SHORT_BINSTRING, UNICODE
            stack.append(self.old_string(op, pos))
            self.depths.append(0)
            return self.pos
        if op == 0x63:  # GLOBAL
            module = self.line(pos)
            name = self.line(self.pos)
            try:
                self.do_global(module.decode("utf-8"), name.decode("utf-8"))
            except UnicodeDecodeError:
                raise FormatError("pickle names a global that is not UTF-8") from None
            return self.pos
        if op == 0x50:  # PERSID (protocol 0)
            line = self.line(pos)
            try:
                pid = line.decode("ascii")
            except UnicodeDecodeError:
                raise FormatError("pickle has a persistent id that is not ASCII") from None
            self.do_persistent(pid, 0)
            return self.pos
        if op in _REFUSED_OPS:
            if op == 0x69:  # INST names its class inline: an unknown one is refused by its name first
                module = self.line(pos)
                name = self.line(self.pos)
                self.grammar.find_class(module.decode("utf-8", "replace"), name.decode("utf-8", "replace"))
            raise UnsafePickleError(
                f"refusing pickle opcode {_REFUSED_OPS[op]} (not used by data; nothing was executed)"
            )
        raise FormatError(f"pickle has an unknown opcode 0x{op:02x} at byte {pos - 1}")

    def line(self, pos: int) -> bytes:
        data = self.data
        end = data.find(b"\n", pos)
        if end < 0:
            raise FormatError(f"pickle is truncated at byte {len(data)} (a line without its end)")
        self.pos = end + 1
        return data[pos:end]

    def old_string(self, op: int, pos: int) -> str:
        """STRING / BINSTRING / SHORT_BINSTRING (Python 2 str, decoded as UTF-8) and UNICODE."""
        data = self.data
        if op == 0x53 or op == 0x56:
            line = self.line(pos)
            if op == 0x56:
                try:
                    return str(line, "raw-unicode-escape")
                except UnicodeDecodeError:
                    raise FormatError("pickle has malformed text") from None
            if len(line) < 2 or line[:1] != line[-1:] or line[:1] not in (b"'", b'"'):
                raise FormatError("pickle has a STRING argument without quotes")
            try:
                raw = codecs.escape_decode(line[1:-1])[0]
            except ValueError:
                raise FormatError("pickle has a malformed STRING argument") from None
        else:
            if op == 0x54:
                k = _i(data, pos)[0]
                pos += 4
                if k < 0:
                    raise FormatError("pickle has a negative string length")
            else:
                k = data[pos]
                pos += 1
            self.blob(pos, k, "text")
            raw = data[pos : pos + k]
            self.pos = pos + k
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError("pickle holds a Python 2 string that is not UTF-8") from None


def _children(value: Any, grammar_children: Any) -> Any:
    t = type(value)
    if t is list or t is tuple or t is set or t is frozenset:
        return value
    if t is dict:
        return [*value.keys(), *value.values()]
    if t is OrderedDict:
        return [*value.keys(), *value.values(), *vars(value).values()]
    if t is str or t is bytes or t in _ATOMS:
        return None
    return grammar_children(value)


def _leaf_weight(value: Any, grammar: Grammar) -> int:
    t = type(value)
    if t is str or t is bytes or t is bytearray:
        return 1 + (len(value) >> 6)
    if t in _ATOMS:
        return 1
    extra, built = grammar.cost(value)
    return 1 + extra + (built >> 6)


def run(data: bytes, grammar: Grammar, limits: Limits | None = None) -> Any:
    """Unpickle `data` under `grammar` and `limits` (see the module docstring)."""
    return Machine(data, grammar, limits).run()
