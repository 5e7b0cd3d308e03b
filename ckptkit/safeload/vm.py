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

import gc
import struct
import time
from collections import OrderedDict
from typing import Any

from ..errors import FormatError, UnsafePickleError
from .machine_state import Grammar, Limits, MachineState, Placeholder, check_keys
from .vm_rare import RareOpcodes

# what the grammar and its callers take from here (the machine's parts live in machine_state and vm_rare)
__all__ = ["Grammar", "Limits", "Machine", "MachineState", "Placeholder", "check_keys", "run"]

_H = struct.Struct("<H").unpack_from
_I = struct.Struct("<I").unpack_from
_i = struct.Struct("<i").unpack_from
_Q = struct.Struct("<Q").unpack_from


class _Stop(Exception):
    pass


class Machine(RareOpcodes):
    """One run over one pickle's bytes."""

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

    # Exempt from the 80-line rule: the interpreter loop runs once per opcode (10M for a large
    # .metadata), so the hot opcodes are inlined branches over local variables; a call per opcode
    # or per group would cost more than the opcode itself.
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


def run(data: bytes, grammar: Grammar, limits: Limits | None = None) -> Any:
    """Unpickle `data` under `grammar` and `limits` (see the module docstring)."""
    return Machine(data, grammar, limits).run()
