"""The fences inside which Python's C unpickler may build a pickle's values (safeload_dcp,
safeload_torchsave): it is 5x faster than ckptkit's own pickle machine (safeload_vm), and no
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

from . import knobs
from .safeload_rules import Refused
from .torch_types import Size

__all__ = ["Call", "Decline", "MAX_WIDE_VALUES", "SizeCall", "run", "scan"]

# opcodes without an argument that pickles of data use (and harmless others: POP, DUP, LIST,
# DICT, SETITEM ...); STOP ends the scan, in Python
_NO_ARG = b"(012N)]}abelstu\x85\x86\x87\x88\x89\x81\x93\x94Rd"
_BINPERSID = b"Q"


# strings this short are matched by the regex too, their length spelled out (one alternative per
# length): a torch.save data.pkl names every parameter several times (60k BINUNICODE in a
# ZeRO-3 model-states file of 20k params), each an iteration of scan's loop otherwise
_SHORT = 128


@lru_cache(maxsize=None)
def _run(top: int, persistent: bool, short: int = 0) -> re.Pattern:
    """Opcodes with no argument (BINPERSID where `persistent`) or one of fixed size: BINGET,
    BINPUT, BININT1 (1 byte); BININT2 (2); LONG_BINGET, BININT (4); FRAME (8); LONG_BINPUT of
    an index below (top + 1) * 2**16; and BINUNICODE and SHORT_BINUNICODE of fewer than `short`
    bytes, all of them in the input (scan's loop takes any other string, and says what is wrong)."""
    no_arg = b"".join(re.escape(bytes([c])) for c in _NO_ARG + (_BINPERSID if persistent else b""))
    put = b"r..[\\x00-" + re.escape(bytes([top])) + b"]\\x00" if top < 256 else b"r...\\x00"
    strings = b"|X(?:" + b"|".join(re.escape(bytes([k, 0, 0, 0])) + b".{%d}" % k for k in range(short)) + \
        b")|\\x8c(?:" + b"|".join(re.escape(bytes([k])) + b".{%d}" % k for k in range(short)) + b")" if short else b""
    return re.compile(b"(?:[" + no_arg + b"]|[hqK].|M..|[jJ]....|\\x95.{8}|" + put + strings + b")*+", re.DOTALL)


def _run_for(n: int, persistent: bool) -> re.Pattern:
    """LONG_BINPUT (protocol 2, ckptkit's own writer) makes the C unpickler size its memo for the
    index named (a 9-byte pickle could ask for gigabytes): the scan lets an index pass at most
    the pickle's length (one entry per input byte: a pickler numbers its entries from 0), inline
    up to the largest multiple of 2**16 below it (2**16 at least, 2**24 at most), beyond that
    one by one."""
    short = min(_SHORT, knobs.MAX_PICKLE_BLOB + 1)  # (a string past the blob limit is the loop's to decline)
    return _run(min(256, max(1, n >> 16)) - 1 if n < 1 << 24 else 256, persistent, max(0, short))


# opcodes that make a container or a rebuilt value: their bytes counted bound the objects made
_MAKERS = b")]}ltd\x85\x86\x87\x81R"
_NOT_MAKERS = bytes(c for c in range(256) if c not in _MAKERS)
# integers of 5-8 bytes (LONG1: storage offsets past 2 GiB) and floats (hyperparameters): each
# could seed a tuple key crafted to share another's hash; this many cost a dictionary at most
# ~1e8 probes
MAX_WIDE_VALUES = 1 << 14
# the longest module or name line of a GLOBAL (protocol 2)
_MAX_NAME = 256


class Decline(Exception):
    """The fast road does not take this pickle: the restricted machine reads it."""


def scan(data: bytes, floats: bool = False, persistent: bool = False) -> None:
    """Raise Decline unless `data` is made only of the opcodes above (BINFLOAT where `floats`,
    BINPERSID where `persistent`), within the limits."""
    n = len(data)
    if n < 3 or data[0] != 0x80 or not 2 <= data[1] <= 5:
        raise Decline
    blob = knobs.MAX_PICKLE_BLOB
    match = _run_for(n, persistent).match
    wide = 0
    pos = 2
    while True:
        pos = match(data, pos).end()
        if pos >= n:
            raise Decline  # no STOP
        op = data[pos]
        if op == 0x8C:  # SHORT_BINUNICODE
            if pos + 1 >= n:
                raise Decline
            pos += 2 + data[pos + 1]
        elif op == 0x58 or op == 0x8D:  # BINUNICODE, BINUNICODE8
            width = 4 if op == 0x58 else 8
            size = int.from_bytes(data[pos + 1:pos + 1 + width], "little")
            if size > blob:
                raise Decline
            pos += 1 + width + size
        elif op == 0x8A:  # LONG1
            if pos + 1 >= n or data[pos + 1] > 8:
                raise Decline
            if data[pos + 1] > 4:
                wide += 1
                if wide > MAX_WIDE_VALUES:
                    raise Decline
            pos += 2 + data[pos + 1]
        elif op == 0x47 and floats:  # BINFLOAT
            wide += 1
            if wide > MAX_WIDE_VALUES:
                raise Decline
            pos += 9
        elif op == 0x72:  # LONG_BINPUT past the inline bound
            if int.from_bytes(data[pos + 1:pos + 5], "little") > max(n, 1 << 16):
                raise Decline
            pos += 5
        elif op == 0x63:  # GLOBAL: two lines
            end = data.find(b"\n", pos + 1, pos + 2 + _MAX_NAME)
            end = data.find(b"\n", end + 1, end + 2 + _MAX_NAME) if end >= 0 else -1
            if end < 0:
                raise Decline
            pos = end + 1
        elif op == 0x2E:  # STOP
            break
        else:
            raise Decline
        if pos > n:
            raise Decline
    objects = len(data.translate(None, _NOT_MAKERS))  # (the makers kept: one pass, 8x less than a count each)
    if objects > max(knobs.MAX_PICKLE_OBJECTS, n // 4):
        raise Decline


class Call:
    """A global the grammar lets a pickle call: its rule builds the value. Takes no state and
    no attributes (a pickle cannot change it for the next one)."""

    __slots__ = ("_rule",)

    def __init__(self, rule: Any) -> None:
        object.__setattr__(self, "_rule", rule)

    def __call__(self, *args: Any) -> Any:
        try:
            return self._rule(args)
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
    def __init__(self, data: bytes, names: dict[tuple[str, str], Any],
                 persistent_load: Callable[[Any], Any] | None) -> None:
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


def run(data: bytes, names: dict[tuple[str, str], Any], check: Callable[[Any], None], floats: bool = False,
        persistent_load: Callable[[Any], Any] | None = None) -> Any | None:
    """The value `data` pickles, built by the C unpickler inside the fences (`names`: the road's
    globals; `check`: its test of the result, raising on anything else), or None: declined."""
    collecting = gc.isenabled()
    if collecting:
        gc.disable()  # millions of new containers, none in a cycle
    try:
        scan(data, floats, persistent_load is not None)
        value = _Unpickler(data, names, persistent_load).load()
        check(value)
        return value
    except Exception:  # noqa: BLE001 - declined (or malformed): the restricted machine reads it and words why
        return None
    finally:
        if collecting:
            gc.enable()
