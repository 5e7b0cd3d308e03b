"""What Python's C unpickler may hash, bounded before it runs (used by safeload.fence).

The C unpickler hashes every dictionary key in C, recursively through nested tuples, with no
recursion limit, no Ctrl-C and no clock: a key nested a million deep overflows the C stack, a key
of 40 shared levels (`t = (t, t)`) hashes for ever. The fence therefore lets tuples reach the C
unpickler only in shapes whose hash is small:

- a tuple the scan's regex sees whole: at most 64 single-opcode items (numbers, short strings,
  None, booleans, empty tuples), or such a tuple wrapped once and passed straight to a call
  (torch.Size's `((5, 10),)`);
- a tuple of any items passed straight to a call, a persistent id or a BUILD (the opcode right
  after it, its memo entry aside): the call (a grammar rule, a stand-in's constructor or state) sees
  it first, and `bounded` declines it unless what a hash of it visits is at most MAX_WEIGHT values;
- a tuple of single-opcode items among which memo fetches (GETs: a GET may fetch a tuple):
  `read_tuple` reads it in Python, and the pickle is rewritten (`patched`) to pass it through
  `checked` as soon as it is made, which declines it (with `bounded`) before anything can fetch it;
- a tuple of any items that goes to no call (torch's `_rebuild_from_type_v2` arguments, an item of
  the call's own tuple): at most MAX_LOOSE of them (safeload.fence), and its memo entry rewritten to
  hold `Fetched` instead: a pickle that fetches it gets a value that declines the load when hashed,
  compared, called or seen by the road's check (a pickler only fetches what it wrote twice).

So every tuple a GET can fetch visits at most MAX_WEIGHT values when hashed, and a fresh one nests
at most MAX_LOOSE deep.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Any, Callable

from .inert import FENCE, Inert

__all__ = [
    "CHECKED",
    "FENCE",
    "Declined",
    "Edits",
    "Fetched",
    "MAX_ITEMS",
    "MAX_WEIGHT",
    "SENTINEL",
    "bounded",
    "check_call",
    "checked",
    "patched",
    "read_tuple",
]

MAX_ITEMS = 64  # items of a tuple read whole (torch.Size has at most 64 dims in practice)
MAX_WEIGHT = 256  # values a hash of a checked tuple visits: a rebuild call's arguments visit ~20

# the global a patched memo entry names (find_class gives `Fetched` for it)
SENTINEL = ("ckptkit.safeload_keys", "Fetched")
_SENTINEL_OP = b"c" + SENTINEL[0].encode() + b"\n" + SENTINEL[1].encode() + b"\n"
_POP = b"0"


class Declined(Exception):
    """Raised where a fenced load must stop (safeload.fence turns it into a Decline)."""


class Fetched:
    """What a GET of a tuple holding memo fetches gives in the fenced road: any use declines."""

    def __hash__(self) -> int:
        raise Declined

    def __eq__(self, other: object) -> bool:
        raise Declined

    def __setstate__(self, state: Any) -> None:
        raise Declined


def bounded(value: Any, limit: int = MAX_WEIGHT) -> None:
    """Raise Declined unless a hash of `value` (through tuples, torch.Size and stand-ins, shared
    parts counted each time) visits at most `limit` values, none of them `Fetched`. A stand-in's
    weight is computed once per load (FENCE.weights): torch shares its layouts and formats."""
    weights = getattr(FENCE, "weights", None)
    todo = [value]
    pop, extend = todo.pop, todo.extend
    while todo:
        v = pop()
        t = type(v)
        if t in _LEAVES:
            limit -= 1
        elif isinstance(v, tuple):
            limit -= 1 + len(v)
            extend(v)
        elif isinstance(v, Inert):
            w = weights.get(id(v)) if weights is not None else None
            if w is None:
                w = _weight(v)
                if weights is not None:
                    weights[id(v)] = w
            limit -= w
        elif t is Fetched:
            raise Declined
        else:
            limit -= 1
        if limit < 0:
            raise Declined


def _weight(inert: Inert) -> int:
    """What a hash of a stand-in visits (Inert.__hash__: its fields, and what is inside them)."""
    left = MAX_WEIGHT
    for value in inert.__dict__.values():
        left -= 1
        if type(value) not in _LEAVES:
            try:
                bounded(value, left)
            except Declined:
                return MAX_WEIGHT + 1
            left -= _inside(value)
    return MAX_WEIGHT - left


def _inside(value: Any) -> int:
    n = 0
    todo = [value]
    while todo:
        v = todo.pop()
        n += 1
        if isinstance(v, tuple):
            todo.extend(v)
        elif isinstance(v, Inert):
            todo.extend(v.__dict__.values())
        if n > MAX_WEIGHT:
            break
    return n


_LEAVES = frozenset({str, int, float, bool, type(None), bytes})


def check_call(args: tuple) -> None:
    """Arguments of a call (REDUCE) or a stand-in's state, while a fenced load runs."""
    if len(args) > MAX_ITEMS:
        raise Declined
    if not set(map(type, args)) <= _LEAVES:
        bounded(args)


def checked(value: tuple) -> tuple:
    """The rewritten pickle's call on each tuple of single-opcode items holding a memo fetch."""
    if len(value) == 1 and type(value[0]) in _LEAVES:
        return value  # (a DCP .metadata's planner paths: a hash of it visits 2 values)
    bounded(value)
    return value


CHECKED = ("ckptkit.safeload_keys", "checked")
_CHECKED_OP = b"c" + CHECKED[0].encode() + b"\n" + CHECKED[1].encode() + b"\n"
_CALL_IT = b"\x85R"  # TUPLE1, REDUCE: checked(the tuple)


class Edits:
    """Insertions into a pickle, in the order of their positions (the scan's), kept compactly:
    a hostile pickle may ask for hundreds of thousands of them (9 bytes each here)."""

    TEXTS = (_CHECKED_OP, _CALL_IT, _SENTINEL_OP, _POP)

    def __init__(self) -> None:
        self.at = array("q")
        self.kind = bytearray()

    def __len__(self) -> int:
        return len(self.at)

    def call(self, start: int, made: int) -> None:
        """Pass the tuple whose items begin at `start` and whose TUPLE opcode ends at `made`
        through `checked`: its GLOBAL before the items, TUPLE1 and REDUCE after the tuple."""
        self.at.extend((start, made))
        self.kind.extend(b"\x00\x01")

    def loose(self, start: int, end: int) -> None:
        """Make the memo opcode at [start, end) memoize `Fetched` in the tuple's place: the GLOBAL
        of `Fetched` before it, POP after it (the tuple is on the stack again)."""
        self.at.extend((start, end))
        self.kind.extend(b"\x02\x03")


def patched(data: bytes, edits: Edits, frames: list[int]) -> bytes:
    """`data` with `edits` inserted, and the FRAMEs at `frames` lengthened by what was inserted
    into them."""
    if not edits:
        return data
    texts = Edits.TEXTS
    grown = array("q", [0])
    for k in edits.kind:
        grown.append(grown[-1] + len(texts[k]))
    lengths = {}
    for at in frames:
        length = int.from_bytes(data[at + 1 : at + 9], "little")
        first, past = bisect.bisect_left(edits.at, at + 9), bisect.bisect_left(edits.at, at + 9 + length)
        if past > first:
            lengths[at] = length + grown[past] - grown[first]
    out = bytearray()
    last = 0
    frames_grown = sorted(lengths)  # (few: one per 64 KB)
    f = 0
    for i, at in enumerate(edits.at):
        while f < len(frames_grown) and frames_grown[f] < at:
            frame = frames_grown[f]
            out += data[last : frame + 1]
            out += lengths[frame].to_bytes(8, "little")
            last = frame + 9
            f += 1
        out += data[last:at]
        out += texts[edits.kind[i]]
        last = at
    for frame in frames_grown[f:]:
        out += data[last : frame + 1]
        out += lengths[frame].to_bytes(8, "little")
        last = frame + 9
    out += data[last:]
    return bytes(out)


# item opcodes read_tuple takes: fixed widths (K, M, J, h, j, None, booleans, empty tuple)
_FIXED = {0x4B: 1, 0x4D: 2, 0x4A: 4, 0x68: 1, 0x6A: 4, 0x4E: 0, 0x88: 0, 0x89: 0, 0x29: 0}
_GETS = (0x68, 0x6A)
_MAKERS = {0x85: 1, 0x86: 2, 0x87: 3}


def read_tuple(
    data: bytes,
    pos: int,
    memo_ok: Callable[[int, int], bool],
    wide: Callable[[], None],
    floats: bool,
    blob: int,
    frames: list[int],
) -> tuple[int, int, bool] | None:
    """The tuple whose first item (or MARK) is at `pos`, read opcode by opcode: (the position after
    its TUPLE opcode, the position after its memo opcode, whether an item is a memo fetch), or
    None where no such tuple begins there: MARK + at most MAX_ITEMS items + TUPLE, or 1-3 items +
    the TUPLE1/2/3 taking them all, each item one opcode (plus its memo opcode; FRAMEs between
    them are noted in `frames`). `memo_ok(op, pos)` checks a memo opcode's index; `wide` counts
    a wide integer or float (and may raise Declined)."""
    mark = data[pos] == 0x28
    pos = pos + 1 if mark else pos
    items: list[int] = []
    seen: list[int] = []
    while True:
        op = data[pos]
        if op == 0x95:
            seen.append(pos)
            pos += 9
            continue
        if (op == 0x74) if mark else (op in _MAKERS):
            if not mark and _MAKERS[op] != len(items):
                return None
            pos += 1
            break
        if len(items) == (MAX_ITEMS if mark else 3) or op not in _ITEMS or (op == 0x47 and not floats):
            return None
        items.append(pos)
        pos = read_memo(data, read_item(data, pos, op, _no_count, floats, blob), memo_ok)[0]
    for at in items:  # (counted once the tuple is known: the loop reads a lone item too)
        if data[at] == 0x8A and data[at + 1] > 4 or data[at] == 0x47:
            wide()
    frames += seen
    return pos, read_memo(data, pos, memo_ok)[0], any(data[at] in _GETS for at in items)


def _no_count() -> None:
    pass


_ITEMS = frozenset(_FIXED) | {0x8C, 0x58, 0x8A, 0x47}


def read_item(data: bytes, pos: int, op: int, wide: Callable[[], None], floats: bool, blob: int) -> int:
    width = _FIXED.get(op)
    if width is not None:
        return pos + 1 + width
    if op == 0x8C or op == 0x58:  # SHORT_BINUNICODE, BINUNICODE
        size = data[pos + 1] if op == 0x8C else int.from_bytes(data[pos + 1 : pos + 5], "little")
        if size > blob:
            raise Declined
        return pos + (2 if op == 0x8C else 5) + size
    if op == 0x8A and data[pos + 1] <= 8:  # LONG1
        if data[pos + 1] > 4:
            wide()
        return pos + 2 + data[pos + 1]
    if op == 0x47 and floats:  # BINFLOAT
        wide()
        return pos + 9
    raise Declined


def read_memo(data: bytes, pos: int, memo_ok: Callable[[int, int], bool]) -> tuple[int, tuple[int, int] | None]:
    op = data[pos] if pos < len(data) else -1
    width = 0 if op == 0x94 else 1 if op == 0x71 else 4 if op == 0x72 else -1
    if width < 0:
        return pos, None
    if not memo_ok(op, pos):
        raise Declined
    return pos + 1 + width, (pos, pos + 1 + width)
