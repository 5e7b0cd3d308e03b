"""numpy values in checkpoints (RNG states, client state), rebuilt as data by ckptkit's own code.

numpy pickles a dtype as `numpy.dtype(spec, align, copy)` plus a state, an array as
`_reconstruct(ndarray, (0,), b'b')` plus a state (version, shape, dtype, fortran, raw bytes), a
scalar as `scalar(dtype, raw bytes)`. Its own __setstate__ trusts those states: a structured dtype
whose field offset lies past the item, or an object dtype, reads or writes outside the array
(a crash, or heap memory shown as values). Here only plain numeric and bool dtypes exist (no
structured, object, void, string, datetime dtypes); the calls return placeholders the BUILD after
them completes, and arrays are made from their raw bytes (frombuffer, reshape, copy) after their
size is checked against their shape.
"""

from __future__ import annotations

import math
from typing import Any

import numpy

from ..errors import FormatError
from .rules import Refused, Rule
from .vm import Placeholder

# numpy's pickled spec for each plain dtype (numpy.dtype(x).__reduce__()[1][0])
PLAIN = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})
MAX_DIMS = 32
MAX_DIM = 1 << 40


class PendingDtype(Placeholder):
    """numpy.dtype(spec) before its state (byte order) arrives."""

    __slots__ = ("spec",)

    def __init__(self, spec: str) -> None:
        self.spec = spec


class PendingArray(Placeholder):
    """_reconstruct(ndarray, (0,), b'b') before its state (shape, dtype, bytes) arrives."""

    __slots__ = ()


def _plain(dtype: Any) -> numpy.dtype:
    if (
        (type(dtype) is not numpy.dtype and not isinstance(dtype, numpy.dtype))
        or dtype.fields is not None
        or dtype.subdtype is not None
        or dtype.hasobject
        or dtype.str[1:] not in PLAIN
    ):
        raise Refused("takes a plain numeric or bool numpy dtype")
    return dtype


def _dtype(args: tuple) -> PendingDtype:
    if (
        not 1 <= len(args) <= 3
        or type(args[0]) is not str
        or args[0] not in PLAIN
        or not all(type(a) is bool for a in args[1:])
    ):
        raise Refused(f"takes one of {', '.join(sorted(PLAIN))} (plain numeric and bool dtypes only)")
    return PendingDtype(args[0])


def _build_dtype(pending: PendingDtype, state: Any) -> numpy.dtype:
    """(3, byteorder, None, None, None, -1, -1, 0), as numpy writes a plain dtype's state."""
    if (
        type(state) is not tuple
        or len(state) not in (8, 9)
        or state[0] not in (3, 4)
        or state[2:5] != (None,) * 3
        or state[1] not in ("<", ">", "|", "=")
        or (len(state) == 9 and state[8] is not None)
    ):
        raise FormatError(
            "a numpy dtype has a state other than a plain dtype's (structured, object and subarray dtypes are refused)"
        )
    base = numpy.dtype(pending.spec)
    if state[5] not in (-1, base.itemsize) or state[6] not in (-1, base.alignment) or state[7] != 0:
        raise FormatError(
            "a numpy dtype has a state other than a plain dtype's (structured, object and subarray dtypes are refused)"
        )
    order = state[1]
    return base if order in ("|", "=") or base.itemsize == 1 else base.newbyteorder(order)


def _reconstruct(args: tuple) -> PendingArray:
    if len(args) != 3 or args[0] is not numpy.ndarray or args[1] != (0,) or args[2] not in (b"b", "b"):
        raise Refused("may only start a plain numpy array (ndarray, (0,), b'b')")
    return PendingArray()


def _array(raw: Any, dtype: Any, shape: Any, fortran: bool) -> numpy.ndarray:
    """An array of `shape` made from exactly its bytes (copied, owning its memory)."""
    try:
        dtype = _plain(dtype)
    except Refused:
        raise FormatError("a numpy array has a dtype other than a plain numeric or bool one") from None
    if (
        type(shape) is not tuple
        or len(shape) > MAX_DIMS
        or not all(type(n) is int and 0 <= n <= MAX_DIM for n in shape)
    ):
        raise FormatError(f"a numpy array has a malformed shape (at most {MAX_DIMS} sizes of 0..2^40)")
    if type(raw) not in (bytes, bytearray):
        raise FormatError("a numpy array's data is not a byte string")
    count = math.prod(shape)
    if count * dtype.itemsize != len(raw):
        raise FormatError(
            f"a numpy array of shape {list(shape)} and dtype {dtype} needs "
            f"{count * dtype.itemsize:,} bytes; its data holds {len(raw):,}"
        )
    if count == 0:
        flat = numpy.zeros(0, dtype=dtype)
    else:
        flat = numpy.frombuffer(raw, dtype=dtype, count=count)
    if dtype.kind == "b" and count and flat.view(numpy.uint8).max() > 1:
        raise FormatError("a numpy bool array holds bytes other than 0 and 1")
    return flat.reshape(shape, order="F" if fortran else "C").copy(order="K")


def _build_array(state: Any) -> numpy.ndarray:
    """(version, shape, dtype, is_fortran, raw bytes), as ndarray.__reduce__ writes it."""
    if type(state) is tuple and len(state) == 5 and state[0] == 1:
        state = state[1:]
    if type(state) is not tuple or len(state) != 4 or type(state[2]) is not bool:
        raise FormatError("a numpy array has a state other than (version, shape, dtype, fortran, bytes)")
    shape, dtype, fortran, raw = state
    array = _array(raw, dtype, shape, fortran)
    if not array.dtype.isnative:  # as numpy's own unpickling does: values kept, byte order native
        array = array.astype(array.dtype.newbyteorder("="), order="K")
    return array


def _scalar(args: tuple) -> Any:
    if len(args) != 2 or type(args[1]) is not bytes:
        raise Refused("takes a plain dtype and its bytes")
    dtype = _plain(args[0])
    if len(args[1]) != dtype.itemsize:
        raise Refused(f"takes {dtype.itemsize} bytes for a {dtype}")
    return _array(args[1], dtype, (), False)[()]


def _frombuffer(args: tuple) -> numpy.ndarray:
    """numpy's protocol 5 pickle: _frombuffer(buffer, dtype, shape, order)."""
    if len(args) != 4 or args[3] not in ("C", "F") or type(args[0]) not in (bytes, bytearray):
        raise Refused("takes bytes, a plain dtype, a shape and 'C' or 'F'")
    _plain(args[1])
    return _array(args[0], args[1], args[2], args[3] == "F")


class NumpyGrammar:
    """The numpy part of the grammar, built when a pickle first names numpy."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], Any] = {("numpy", "ndarray"): numpy.ndarray}
        self._rules: dict[int, tuple[Any, Rule]] = {}

        def add(module: str, name: str, rule: Rule) -> None:
            self.values[(module, name)] = rule
            self._rules[id(rule)] = (rule, rule)

        add("numpy", "dtype", _dtype)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            add(module, "_reconstruct", _reconstruct)
            add(module, "scalar", _scalar)
        for module in ("numpy.core.numeric", "numpy._core.numeric"):
            add(module, "_frombuffer", _frombuffer)

    def rule(self, func: Any) -> Rule | None:
        entry = self._rules.get(id(func))
        return entry[1] if entry is not None and entry[0] is func else None

    def build(self, obj: Placeholder, state: Any) -> Any:
        if type(obj) is PendingDtype:
            return _build_dtype(obj, state)
        if type(obj) is PendingArray:
            return _build_array(state)
        raise FormatError(f"a {type(obj).__name__} cannot be given a state")

    def is_costly(self, t: type) -> bool:
        return issubclass(t, (numpy.ndarray, numpy.generic))

    def cost(self, value: Any) -> tuple[int, int]:
        if isinstance(value, (numpy.ndarray, numpy.generic)):
            return 0, value.nbytes
        return 0, 0


_GRAMMAR: NumpyGrammar | None = None


def grammar() -> NumpyGrammar:
    global _GRAMMAR
    if _GRAMMAR is None:
        _GRAMMAR = NumpyGrammar()
    return _GRAMMAR
