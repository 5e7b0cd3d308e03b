"""Pickles as editable opcode lists, and the oracle's operators on a torch.save `data.pkl`.

A pickle is parsed with pickletools.genops into [(opcode, arg)], edited, and encoded back (the
arguments re-encoded, so a changed int or string keeps a valid opcode). The operators change what
the bytes mean while keeping the pickle well formed: a storage type or key inside a persistent id,
an int argument (offset, size, stride, numel), a string (a dict key, a device), a dict entry
duplicated, two entries' order swapped.
"""

from __future__ import annotations

import pickletools
import random
import struct

Op = tuple  # (pickletools.OpcodeInfo, argument)
OPS = {op.name: op for op in pickletools.opcodes}
STORAGE_TYPES = (
    "FloatStorage",
    "HalfStorage",
    "BFloat16Storage",
    "DoubleStorage",
    "LongStorage",
    "IntStorage",
    "ShortStorage",
    "CharStorage",
    "ByteStorage",
    "BoolStorage",
)


def parse(data: bytes) -> list[Op]:
    return [(op, arg) for op, arg, _ in pickletools.genops(data) if op.name != "FRAME"]


def _arg_bytes(op: pickletools.OpcodeInfo, arg) -> bytes:
    kind = op.arg.name if op.arg is not None else None
    if kind is None:
        return b""
    if kind == "uint1":
        return struct.pack("<B", arg)
    if kind == "uint2":
        return struct.pack("<H", arg)
    if kind == "int4":
        return struct.pack("<i", arg)
    if kind == "uint4":
        return struct.pack("<I", arg)
    if kind == "uint8":
        return struct.pack("<Q", arg)
    if kind == "long1":
        raw = pickle_long(arg)
        return struct.pack("<B", len(raw)) + raw
    if kind == "float8":
        return struct.pack(">d", arg)
    if kind == "stringnl_noescape_pair":
        module, name = arg.split(" ", 1)
        return f"{module}\n{name}\n".encode()
    if kind in ("unicodestring1", "unicodestring4", "unicodestring8"):
        raw = arg.encode("utf-8", "surrogatepass")
        width = {"unicodestring1": "<B", "unicodestring4": "<I", "unicodestring8": "<Q"}[kind]
        return struct.pack(width, len(raw)) + raw
    if kind in ("bytes1", "bytes4", "bytes8"):
        width = {"bytes1": "<B", "bytes4": "<I", "bytes8": "<Q"}[kind]
        return struct.pack(width, len(arg)) + arg
    raise NotImplementedError(f"no encoder for {op.name}'s argument {kind}")


def pickle_long(value: int) -> bytes:
    if value == 0:
        return b""
    n = (value.bit_length() + 8) // 8
    return value.to_bytes(n, "little", signed=True)


def encode(ops: list[Op]) -> bytes:
    return b"".join(op.code.encode("latin-1") + _arg_bytes(op, arg) for op, arg in ops)


def int_op(value: int) -> Op:
    """The smallest opcode that pushes `value`."""
    if 0 <= value < 256:
        return (OPS["BININT1"], value)
    if 0 <= value < 65536:
        return (OPS["BININT2"], value)
    if -(1 << 31) <= value < (1 << 31):
        return (OPS["BININT"], value)
    return (OPS["LONG1"], value)


def str_op(value: str) -> Op:
    return (OPS["BINUNICODE"], value)


def global_op(module: str, name: str) -> Op:
    return (OPS["GLOBAL"], f"{module} {name}")


MEMO_PUTS = ("BINPUT", "LONG_BINPUT", "MEMOIZE")


def persid_ops(ops: list[Op]) -> list[dict]:
    """Each persistent id ('storage', type, key, location, numel): the op index of each part's
    push (a memo put after it is skipped), and the storage type's name."""
    out = []
    for i, (op, _) in enumerate(ops):
        if op.name != "BINPERSID":
            continue
        end = i - 1 if ops[i - 1][0].name not in MEMO_PUTS else i - 2
        if ops[end][0].name != "TUPLE":
            continue
        mark = max(j for j in range(end) if ops[j][0].name == "MARK")
        parts = [j for j in range(mark + 1, end) if ops[j][0].name not in MEMO_PUTS]
        if len(parts) != 5:
            continue
        out.append(
            {
                "type": parts[1],
                "key": parts[2],
                "location": parts[3],
                "numel": parts[4],
                "type_name": _pushed(ops, parts[1]),
                "key_name": _pushed(ops, parts[2]),
                "numel_value": _pushed(ops, parts[4]),
            }
        )
    return out


def _pushed(ops: list[Op], i: int):
    """What the op at `i` pushes, where it is a plain value or a memo get of one."""
    op, arg = ops[i]
    if op.name in ("BINGET", "LONG_BINGET"):
        for j in range(i):
            if ops[j][0].name in ("BINPUT", "LONG_BINPUT") and ops[j][1] == arg:
                return _pushed(ops, j - 1)
        return None
    if op.name == "GLOBAL":
        return arg.split(" ", 1)[1]
    return arg


def replace_push(ops: list[Op], i: int, new: Op) -> list[Op]:
    """The value pushed at `i` becomes `new`'s, for this use only: where a memo put follows, the
    later memo gets of that entry push the old value themselves (torch's weights-only unpickler
    has no POP, so the old value cannot be memoised and dropped)."""
    out = list(ops)
    out[i] = new
    if i + 1 < len(ops) and ops[i + 1][0].name in ("BINPUT", "LONG_BINPUT"):
        slot = ops[i + 1][1]
        for j in range(i + 2, len(ops)):
            name = ops[j][0].name
            if name in ("BINPUT", "LONG_BINPUT") and ops[j][1] == slot:
                break
            if name in ("BINGET", "LONG_BINGET") and ops[j][1] == slot:
                out[j] = ops[i]
    return out


def set_storage_type(ops: list[Op], pid: dict, name: str) -> list[Op]:
    return replace_push(ops, pid["type"], global_op("torch", name))


def int_positions(ops: list[Op]) -> list[int]:
    return [i for i, (op, _) in enumerate(ops) if op.name in ("BININT", "BININT1", "BININT2", "LONG1")]


def str_positions(ops: list[Op]) -> list[int]:
    return [i for i, (op, _) in enumerate(ops) if op.name in ("BINUNICODE", "SHORT_BINUNICODE")]


def near_ints(rng: random.Random, value: int) -> int:
    return rng.choice(
        [0, 1, value - 1, value + 1, value * 2, value // 2, value + rng.randint(2, 64), -1, 1 << 31, 1 << 62]
    )


def setitem_pairs(ops: list[Op]) -> list[tuple[int, int]]:
    """(start, end) op ranges of the `key value` pairs inside SETITEMS batches whose keys are
    strings (a state dict's entries), found by simulating the stack depth."""
    pairs, marks = [], []
    for i, (op, _) in enumerate(ops):
        if op.name == "MARK":
            marks.append(i)
        elif pickletools.markobject in op.stack_before and marks:
            mark = marks.pop()
            if op.name == "SETITEMS":
                pairs += _pairs_in(ops, mark + 1, i)
    return pairs


KEYS = ("BINUNICODE", "SHORT_BINUNICODE")


def _pairs_in(ops: list[Op], start: int, end: int) -> list[tuple[int, int]]:
    out, i = [], start
    while i < end and ops[i][0].name in KEYS:
        depth, marks, j = 0, [], i
        while j < end:
            depth, marks = _step(ops[j][0], depth, marks)
            j += 1
            if depth == 2 and (j == end or ops[j][0].name in KEYS):
                break
        if depth != 2:
            return out
        out.append((i, j))
        i = j
    return out


def _step(op: pickletools.OpcodeInfo, depth: int, marks: list[int]) -> tuple[int, list[int]]:
    """The stack depth after `op` (a mark counts as one slot)."""
    before = op.stack_before
    if op.name == "MARK":
        return depth + 1, marks + [depth]
    if pickletools.markobject in before:
        below = before.index(pickletools.markobject)
        return marks[-1] - below + len(op.stack_after), marks[:-1]
    return depth - len(before) + len(op.stack_after), marks
