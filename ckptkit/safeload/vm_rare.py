"""The opcodes real checkpoints seldom use (see safeload.vm): older protocols' text opcodes,
big or odd binary values, sets, DICT and LIST from a MARK, POP and DUP, and those refused outright.
"""

from __future__ import annotations

import codecs
import struct
from collections import OrderedDict
from typing import Any

from ..errors import FormatError, UnsafePickleError
from .machine_state import MachineState, check_keys

_I = struct.Struct("<I").unpack_from
_i = struct.Struct("<i").unpack_from
_Q = struct.Struct("<Q").unpack_from
_D = struct.Struct(">d").unpack_from

MAX_INT_BYTES = 128  # LONG1 / LONG4: Python ints of more than 1024 bits are no checkpoint's data
MAX_TEXT_LINE = 512  # INT / LONG / FLOAT / GET / PUT arguments of protocol 0

_REFUSED_OPS = {
    ord("i"): "INST",
    ord("o"): "OBJ",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
}


# the opcodes each group of RareOpcodes executes
_BINARY_OPS = frozenset({0x80, 0x47, 0x43, 0x42, 0x8E, 0x96, 0x8D, 0x8A, 0x8B})
_STACK_OPS = frozenset({0x51, 0x92, 0x73, 0x8F, 0x90, 0x91, 0x6C, 0x64, 0x30, 0x31, 0x32, 0x68, 0x6A})
_TEXT_OPS = frozenset({0x67, 0x70, 0x49, 0x4C, 0x46, 0x53, 0x54, 0x55, 0x56, 0x63, 0x50})


class RareOpcodes(MachineState):
    """The machine's seldom used opcodes, each group a method."""

    def rare(self, op: int, pos: int) -> int:
        """Execute one of the less frequent opcodes whose argument starts at `pos`; the next position."""
        self.pos = pos
        if op in _BINARY_OPS:
            return self.binary_value(op, pos)
        if op in _STACK_OPS:
            return self.stack_op(op, pos)
        if op in _TEXT_OPS:
            return self.text_op(op, pos)
        if op in _REFUSED_OPS:
            if op == 0x69:  # INST names its class inline: an unknown one is refused by its name first
                module = self.line(pos)
                name = self.line(self.pos)
                self.grammar.find_class(module.decode("utf-8", "replace"), name.decode("utf-8", "replace"))
            raise UnsafePickleError(
                f"refusing pickle opcode {_REFUSED_OPS[op]} (not used by data; nothing was executed)"
            )
        raise FormatError(f"pickle has an unknown opcode 0x{op:02x} at byte {pos - 1}")

    def binary_value(self, op: int, pos: int) -> int:
        """PROTO, and values of the binary protocols the loop leaves: floats, bytes, long text, big ints."""
        data = self.data
        stack = self.stack
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
        raise AssertionError(op)  # (rare sends only the opcodes of this group)

    def stack_op(self, op: int, pos: int) -> int:
        """Persistent ids, NEWOBJ_EX, single SETITEMs, sets, LIST and DICT from a MARK, POP and DUP."""
        stack = self.stack
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
        raise AssertionError(op)  # (rare sends only the opcodes of this group)

    def text_op(self, op: int, pos: int) -> int:  # noqa: C901 - protocol 0's opcodes, one branch each
        """Protocol 0: numbers and memo indexes as text lines, quoted strings, GLOBAL, PERSID."""
        stack = self.stack
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
        raise AssertionError(op)  # (rare sends only the opcodes of this group)

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
