"""The fences inside which Python's C unpickler may build a pickle's values (safeload.dcp,
safeload.torchsave): it is 5x faster than ckptkit's own pickle machine (safeload.vm), and no
restricted loader on its own (a 9-byte LONG_BINPUT makes it allocate gigabytes; it builds any
nesting and any sharing; BUILD sets state on whatever it is given).

- `scan`: the opcodes, at regex speed, before anything is built: protocol 2 to 5; only opcodes
  with no argument or one of fixed size, strings, LONG1, GLOBAL's two lines (and, where a road
  allows them, floats and persistent ids); no memo index past the pickle's length; every length
  within the input and the blob limit; at most MAX_WIDE_VALUES integers of more than 4 bytes
  and floats (the values a tuple key needs to be crafted into sharing another's hash: with ints
  of 4 bytes at most, no dictionary can be made quadratic); containers within the machine's
  object limit (their opcode bytes counted, an upper bound).
- `Call`: a global the grammar lets a pickle call, its rule checking the arguments; it takes no
  state and no attribute (nothing a pickle does to it is seen by the next). The stand-ins take
  a state only as the grammar gives it (Inert.__setstate__ is the grammar's BUILD); the interned
  dtypes and globals refuse one (torch_types).
- `run`: scan, unpickle with a road's globals, then the road's check of the result; any failure
  is a `Decline` and gives None: the caller runs the restricted machine, which accepts or words
  the refusal.
"""

from __future__ import annotations

import gc
import io
import pickle
import re
from functools import lru_cache
from typing import Any, Callable

from .. import knobs
from .keys import (
    CHECKED,
    SENTINEL,
    Declined,
    Edits,
    Fetched,
    read_item,
    read_memo,
    check_call,
    checked,
    patched,
    read_tuple,
)
from .rules import Refused, pickle_account
from .inert import FENCE
from ..torch_types import Size

__all__ = ["Call", "Decline", "MAX_WIDE_VALUES", "SizeCall", "run", "scan"]

# opcodes without an argument that pickles of data use, none of them making a tuple or
# memoizing: the values among them (empty list and dict, LIST, DICT, STACK_GLOBAL, REDUCE,
# NEWOBJ) may be followed by a memo opcode, the others (MARK aside: see _MARK) not; STOP ends the
# scan, in Python. POP, POP_MARK and DUP are not among them: pickles of data never use them,
# and they would put a tuple back under a later memo opcode
_VALUES = b"]}ld\x93R\x81"
_OTHERS = b"abesu"
_BINPERSID = b"Q"


# strings this short are matched by the regex too, their length spelled out (one alternative per
# length): a torch.save data.pkl names every parameter several times (60k BINUNICODE in a
# ZeRO-3 model-states file of 20k params), each an iteration of scan's loop otherwise
_SHORT = 128


def _strings(short: int) -> bytes:
    """BINUNICODE and SHORT_BINUNICODE of fewer than `short` bytes, their lengths spelled out
    (in groups of 8 lengths, each behind a test of the length byte: one alternative per length
    would be tried one after the other)."""
    if not short:
        return b"(?!)"

    def spelled(op: bytes, pad: bytes) -> bytes:
        groups = []
        for low in range(0, short, 8):
            high = min(short, low + 8) - 1
            lengths = b"|".join(re.escape(bytes([k]) + pad) + b".{%d}" % k for k in range(low, high + 1))
            groups.append(
                b"(?=[" + re.escape(bytes([low])) + b"-" + re.escape(bytes([high])) + b"])(?:" + lengths + b")"
            )
        return op + b"(?:" + b"|".join(groups) + b")"

    return spelled(b"X", b"\0\0\0") + b"|" + spelled(b"\\x8c", b"")


@lru_cache(maxsize=None)
def _run(top: int, persistent: bool, short: int = _SHORT) -> re.Pattern:
    """The opcodes the regex takes (scan's loop takes the rest, or declines): every value
    opcode with at most one memo opcode after it (BINPUT, MEMOIZE, LONG_BINPUT of an index below
    (top + 1) * 2**16), and tuples only in the shapes safeload.keys describes:

    - a tuple of at most 64 single-opcode items other than memo fetches (numbers, strings of
      fewer than `short` bytes, None, booleans, empty tuples), optionally wrapped once and
      passed straight to REDUCE;
    - TUPLE after a MARK whose items are any values, passed straight to REDUCE, BUILD or
      BINPERSID (where `persistent`), or wrapped once and passed to REDUCE;
    - where a tuple of single-opcode items including a memo fetch begins (at a memo fetch or a
      MARK), the regex stops: the loop reads it (safeload.keys.read_tuple).
    """
    memo = b"(?:\\x94|q.|" + (b"r..[\\x00-" + re.escape(bytes([top])) + b"]\\x00" if top < 256 else b"r...\\x00") + b")"
    memo_opt = b"(?:" + memo + b")?+"
    atom = b"(?:K.|M..|J....|[N\\x88\\x89)]|" + _strings(short) + b")" + memo_opt
    get = b"(?:h.|j....)" + memo_opt
    item = b"(?:" + atom + b"|" + get + b")"
    consumers = b"R" + memo_opt + b"|b|\\x85" + memo_opt + b"R" + memo_opt + (b"|Q" + memo_opt if persistent else b"")
    wrapped = b"(?:\\x85" + memo_opt + b"R" + memo_opt + b")?"
    # an item, or the first of a tuple of items (no memo fetch among them)
    # (a lone item never just before a FRAME, or one item before it: a tuple whose items a FRAME
    # splits is read_tuple's, from its first item, and the regex stops there)
    framed = b"\\x95|" + item + b"\\x95"
    atoms = (
        atom + b"(?:(?:\\x85|" + atom + b"(?:\\x86|" + atom + b"\\x87))" + memo_opt + wrapped + b"|(?!" + framed + b"))"
    )
    flat = b"\\((?:" + atom + b"){0,64}+t" + memo_opt + wrapped
    general = b"t" + memo_opt + b"(?:" + consumers + b")"
    # a memo fetch where no tuple of single-opcode items begins
    get_alone = get + b"(?!\\x85|\\x95|" + item + b"(?:[\\x86\\x87\\x95]|" + item + b"\\x87))"
    # the same, seen sooner where no string follows (the lookahead above tries every string
    # length group at each item): fixed-width items only, then an opcode that cannot go on
    fixed = b"(?:K.|M..|J....|[N\\x88\\x89)]|h.|j....)" + memo_opt
    starts = b"KMJN\\x88\\x89)hjX\\x8c"
    get_fast = (
        get
        + b"(?=[^"
        + starts
        + b"\\x85\\x95]|"
        + fixed
        + b"(?:[^"
        + starts
        + b"\\x86\\x87\\x95]|"
        + fixed
        + b"[^\\x87]))"
    )
    values = b"[" + re.escape(_VALUES + (_BINPERSID if persistent else b"")) + b"]" + memo_opt
    others = b"[" + re.escape(_OTHERS) + b"]"  # (FRAME: the loop, which notes where it is)
    # a MARK where no tuple of single-opcode items (one a memo fetch) begins that goes to no call
    mark = b"\\((?!(?:" + item + b"){0,64}+t" + memo_opt + b"(?!" + consumers + b"))"
    # the same, seen sooner where the items are of fixed width
    mark_fast = b"\\((?=(?:" + fixed + b"){0,64}+(?:[^" + starts + b"t]|t" + memo_opt + b"(?:" + consumers + b")))"
    # (the most frequent first: the alternatives begin with distinct opcodes, flat and the marks
    # aside, whose order is kept)
    return re.compile(
        b"(?:" + b"|".join((get_fast, values, atoms, others, get_alone, flat, mark_fast, mark, general)) + b")*+",
        re.DOTALL,
    )


def memo_cap(n: int) -> int:
    """The largest memo index a pickle of `n` bytes may name: the C unpickler keeps 16 bytes per
    index up to the largest named (a 9-byte LONG_BINPUT could ask for gigabytes), charged to the
    pickle's memory account (half of it at most); a pickler numbers its entries from 0, and each
    costs its pickle 2 bytes at least."""
    return max(1 << 16, min(n // 2, pickle_account(n) // (2 * _MEMO_ENTRY)))


def _run_for(n: int, persistent: bool) -> re.Pattern:
    """The regex for a pickle of `n` bytes: LONG_BINPUT inline up to the largest multiple of
    2**16 below memo_cap(n) (2**24 at most; the loop declines the others)."""
    short = min(_SHORT, knobs.MAX_PICKLE_BLOB + 1)  # (a string past the blob limit is the loop's to decline)
    cap = memo_cap(n)
    return _run(min(256, max(1, cap >> 16)) - 1 if cap < 1 << 24 else 256, persistent, max(0, short))


# opcodes that make a container or a rebuilt value: their bytes counted bound the objects made
_MAKERS = b")]}ltd\x85\x86\x87\x81R"
_NOT_MAKERS = bytes(c for c in range(256) if c not in _MAKERS)
# integers of 5-8 bytes (LONG1: storage offsets past 2 GiB) and floats (hyperparameters): each
# could seed a tuple key crafted to share another's hash; this many cost a dictionary at most
# ~1e8 probes
MAX_WIDE_VALUES = 1 << 14
# the longest module or name line of a GLOBAL (protocol 2)
_MAX_NAME = 256
# tuples of other values that go to no call (safeload.keys): one may hold the one before, so they
# bound the depth of a dictionary key the C unpickler hashes (recursively, on the C stack)
MAX_LOOSE_TUPLES = 10_000
# bytes the C unpickler may spend on one object, and on one memo index (its memo doubles as it
# grows: 8 bytes a pointer, twice)
OBJECT_BYTES = 64
_MEMO_ENTRY = 16
_ITEM_OPS = frozenset(b"KMJN\x88\x89)hj\x8cX\x8aG(")
# a tuple of one memo fetch (a DCP .metadata's planner_data holds one per tensor): what
# read_tuple reads there, at regex speed
_FETCH_TUPLE1 = re.compile(b"(?:h.|j....)\\x85", re.DOTALL)


class Decline(Exception):
    """The fast road does not take this pickle: the restricted machine reads it."""


def scan(data: bytes, floats: bool = False, persistent: bool = False) -> tuple[Edits, list[int]]:
    """Raise Decline unless `data` is made only of the opcodes above (BINFLOAT where `floats`,
    BINPERSID where `persistent`), within the limits; else the edits safeload.keys.patched makes
    (the tuples holding memo fetches checked, the others' memo entries made unfetchable) and the
    positions of the FRAMEs."""
    n = len(data)
    if n < 3 or data[0] != 0x80 or not 2 <= data[1] <= 5:
        raise Decline
    blob = knobs.MAX_PICKLE_BLOB
    cap = memo_cap(n)
    match = _run_for(n, persistent).match
    wide = [0]
    edits = Edits()
    frames: list[int] = []
    loose = 0

    def count_wide() -> None:
        wide[0] += 1
        if wide[0] > MAX_WIDE_VALUES:
            raise Declined

    def memo_ok(op: int, at: int) -> bool:
        return op != 0x72 or int.from_bytes(data[at + 1 : at + 5], "little") <= cap

    pos = 2
    try:
        while True:
            pos = match(data, pos).end()
            if pos >= n:
                raise Decline  # no STOP
            op = data[pos]
            if op == 0x2E:  # STOP
                break
            if op == 0x95:  # FRAME
                frames.append(pos)
                pos += 9
                continue
            if op == 0x74:  # TUPLE of other values, going to no call (torch's _rebuild_from_type_v2 arguments)
                loose += 1
                if loose > MAX_LOOSE_TUPLES:
                    raise Decline  # (each may hold the one before: they bound a key's depth)
                pos, span = read_memo(data, pos + 1, memo_ok)
                if span is not None:
                    edits.loose(*span)
                continue
            if op == 0x68 or op == 0x6A:
                one = _FETCH_TUPLE1.match(data, pos)
                if one is not None:
                    made = one.end()
                    edits.call(pos, made)
                    pos = read_memo(data, made, memo_ok)[0]
                    continue
            if op in _ITEM_OPS:
                got = read_tuple(data, pos, memo_ok, count_wide, floats, blob, frames)
                if got is not None:
                    made, end, fetch = got
                    if fetch:
                        edits.call(pos, made)
                    elif data[end] == 0x85:  # (a FRAME split the tuple: the regex left its wrapping too)
                        end = _past_wrapping(data, end, memo_ok)
                    pos = end
                    continue
                if op == 0x28:
                    raise Decline  # (a MARK the regex left: a tuple it cannot take)
            pos = _value(data, pos, op, count_wide, floats, blob)
            pos = read_memo(data, pos, memo_ok)[0]
            if pos > n:
                raise Decline
    except (Declined, IndexError):
        raise Decline from None
    account = pickle_account(n)
    objects = len(data.translate(None, _NOT_MAKERS))  # (the makers kept: one pass, 8x less than a count each)
    if (
        objects > max(knobs.MAX_PICKLE_OBJECTS, n // 4)
        or objects * OBJECT_BYTES > account
        or data.count(b"\x94") * _MEMO_ENTRY > account // 2
    ):
        raise Decline
    return edits, frames


def _past_wrapping(data: bytes, pos: int, memo_ok: Callable[[int, int], bool]) -> int:
    """Past a tuple's wrapping, TUPLE1 then REDUCE (each with its memo opcode), at `pos`: what the
    regex takes after a tuple of single-opcode items without a memo fetch (`wrapped`)."""
    pos = read_memo(data, pos + 1, memo_ok)[0]
    if data[pos] != 0x52:
        raise Decline
    return read_memo(data, pos + 1, memo_ok)[0]


def _value(data: bytes, pos: int, op: int, wide: Callable[[], None], floats: bool, blob: int) -> int:
    """One value opcode the regex does not take: a string, a wide integer or float, a GLOBAL,
    or a single-opcode item where the regex saw a tuple begin that read_tuple did not read."""
    if op == 0x8D:  # BINUNICODE8
        size = int.from_bytes(data[pos + 1 : pos + 9], "little")
        if size > blob:
            raise Declined
        return pos + 9 + size
    if op == 0x63:  # GLOBAL: two lines
        end = data.find(b"\n", pos + 1, pos + 2 + _MAX_NAME)
        end = data.find(b"\n", end + 1, end + 2 + _MAX_NAME) if end >= 0 else -1
        if end < 0:
            raise Declined
        return end + 1
    if op in _ITEM_OPS:
        return read_item(data, pos, op, wide, floats, blob)
    raise Declined


class Call:
    """A global the grammar lets a pickle call: its rule builds the value. Takes no state and
    no attributes (a pickle cannot change it for the next one)."""

    __slots__ = ("rule",)

    def __init__(self, rule: Any) -> None:
        object.__setattr__(self, "rule", rule)

    def __call__(self, *args: Any) -> Any:
        check_call(args)
        try:
            return self.rule(args)
        except Refused:
            raise Decline from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise Decline

    def __setstate__(self, state: Any) -> None:
        raise Decline


class SizeCall(Call):
    """torch.Size, called 4 times per tensor of a .metadata: the grammar's check inline for a
    tuple of at most 64 ints in [-2**63, 2**63), its rule (and its sentence) for anything else."""

    __slots__ = ()

    def __call__(self, *args: Any) -> Any:
        if len(args) == 1:
            t = args[0]
            if type(t) is tuple:
                if len(t) == 1:  # (most of them: a 1-d tensor's size, offsets and chunk sizes)
                    x = t[0]
                    if type(x) is int and -_I64 <= x < _I64:
                        return Size(t)
                elif len(t) <= 64 and (not t or (set(map(type, t)) <= _INT and -_I64 <= min(t) and max(t) < _I64)):
                    return Size(t)
        return Call.__call__(self, *args)


_I64 = 1 << 63
_INT = {int}


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, data: bytes, names: dict[tuple[str, str], Any], persistent_load: Callable[[Any], Any] | None
    ) -> None:
        super().__init__(io.BytesIO(data), fix_imports=False)
        self._names = names
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        value = self._names.get((module, name))
        if value is None:
            raise Decline
        return value

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise Decline
        return self._persistent(pid)


def run(
    data: bytes,
    names: dict[tuple[str, str], Any],
    check: Callable[[Any], None],
    floats: bool = False,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any | None:
    """The value `data` pickles, built by the C unpickler inside the fences (`names`: the road's
    globals; `check`: its test of the result, raising on anything else), or None: declined."""
    collecting = gc.isenabled()
    if collecting:
        gc.disable()  # millions of new containers, none in a cycle
    FENCE.check = check_call  # (the stand-ins check their arguments and tuple states)
    FENCE.weights = {}
    try:
        data = patched(data, *scan(data, floats, persistent_load is not None))
        value = _Unpickler(data, {**names, SENTINEL: Fetched, CHECKED: checked}, _checked(persistent_load)).load()
        check(value)
        return value
    except Exception:  # noqa: BLE001 - declined (or malformed): the restricted machine reads it and words why
        return None
    finally:
        FENCE.check = FENCE.weights = None
        if collecting:
            gc.enable()


def _checked(persistent_load: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """A persistent id is a tuple of any items (BINPERSID takes it whole): checked first."""
    if persistent_load is None:
        return None

    def load(pid: Any) -> Any:
        check_call((pid,))
        return persistent_load(pid)

    return load
