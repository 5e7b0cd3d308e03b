"""The pickle machine's state and bookkeeping (see safeload.vm): the stack with each value's
nesting depth, the memo, the counts of objects, expanded size and bytes built against their limits,
and the stack operations every opcode is made of. The opcodes themselves run in vm (the hot loop)
and vm_rare (the rest).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any, Protocol

from .. import knobs
from ..errors import FormatError
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


EXPANDED_PER_BYTE = 4  # the expanded-size limit of a large pickle: this many values per input byte
MAX_SAME_HASH = 64  # keys of one set sharing one hash: more are crafted (each insert walks them all)
OBJECT_BYTES = 64  # what one object costs the memory account at least (an empty dict: 64 bytes)

# values with nothing inside them whose expanded size is 1 (text and bytes weigh by length)
_ATOMS = frozenset({int, float, bool, type(None), complex, type, FunctionType, slice})

_EXPANDED = "expands to more values than allowed when shared parts are counted each time they are reached"


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


class MachineState:
    """One run's state over one pickle's bytes, and the steps opcodes are made of."""

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
