"""A pickle's FRAMEs put back at other opcode boundaries, as a pickler may commit them.

Python's pickler closes a 64 KB frame before the next object it saves, wherever that falls: between
two items of a tuple as well as between two records. A test that reads only small pickles (one
frame) never sees a tuple split by a FRAME; `reframed` makes one of any size do.
"""

from __future__ import annotations

import pickletools

# the opcodes of a tuple's single-opcode items, and the memo opcodes that may follow one
_ITEMS = {
    "BININT1",
    "BININT2",
    "BININT",
    "BINGET",
    "LONG_BINGET",
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "NONE",
    "NEWTRUE",
    "NEWFALSE",
    "EMPTY_TUPLE",
}
_MEMO = {"MEMOIZE", "BINPUT", "LONG_BINPUT"}


def reframed(data: bytes) -> bytes:
    """`data` (protocol 4 or 5) with a frame beginning before every item that follows another item:
    every tuple of two or three items is split by a FRAME."""
    ops = [(op.name, pos) for op, _, pos in pickletools.genops(data)]
    ends = [pos for _, pos in ops[1:]] + [len(data)]
    proto_end = ends[0]
    frames: list[bytearray] = [bytearray()]
    previous = None
    for (name, pos), end in zip(ops[1:], ends[1:]):
        if name == "FRAME":
            continue
        if name in _ITEMS and previous in _ITEMS:
            frames.append(bytearray())
        frames[-1] += data[pos:end]
        if name not in _MEMO:
            previous = name
    out = bytearray(data[:proto_end])
    for frame in frames:
        if frame:
            out += b"\x95" + len(frame).to_bytes(8, "little") + frame
    return bytes(out)
