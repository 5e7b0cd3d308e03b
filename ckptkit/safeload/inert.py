"""Stand-ins for the foreign classes a checkpoint pickles: plain data, never the class's code.

The restricted unpickler builds one for each class it allows as data (DCP metadata, DeepSpeed's
small state classes); torch_types.realize and repickle read them back. Kept apart from the
unpickler so that the stand-ins of torch's own types (torch_types), below it, can know them.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import UnsafePickleError, quote

_HASH_SALT = int.from_bytes(os.urandom(8), "little")


# set by safeload.fence while Python's C unpickler runs: the check the stand-ins' arguments and
# tuple states pass first (safeload.keys.check_call)
FENCE = threading.local()


class Inert:
    """A foreign object rebuilt as plain data: constructor arguments and pickled state only."""

    _qualname = "Inert"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check = getattr(FENCE, "check", None)
        if check is not None:
            check(args)
        self.__dict__["_args"] = args
        if kwargs:
            self.__dict__["_kwargs"] = kwargs

    def __setstate__(self, state: Any) -> None:
        # the grammar's BUILD, whoever unpickles a stand-in (the C unpickler in safeload.dcp
        # calls this for each of a .metadata's 500k objects: the plain case inline)
        kind = type(state)
        if kind is dict and set(map(type, state)) <= _STR and state.keys().isdisjoint(_INERT_ATTRS):
            self.__dict__.update(state)
        elif kind is tuple and len(state) != 2:  # kept as `_state`, as apply_inert_state does (a
            check = getattr(FENCE, "check", None)  # TensorProperties: 100k in a .metadata)
            if check is not None:
                check(state)
            self.__dict__["_state"] = state
        else:
            check = getattr(FENCE, "check", None)
            if check is not None and kind is not dict:
                check((state,))
            apply_inert_state(self, state)

    def __reduce__(self):  # re-emitting a stand-in pickles it as the original class
        return (_inert_rebuild, (self._qualname, self.__dict__.get("_args", ())), self._public_state())

    def _public_state(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_args", "_kwargs")}

    def to_data(self) -> dict:
        """A JSON-friendly view: class name, arguments, state."""
        out: dict[str, Any] = {"__class__": self._qualname}
        if self.__dict__.get("_args"):
            out["args"] = list(self.__dict__["_args"])
        out.update(self._public_state())
        return out

    def __repr__(self) -> str:
        args = self.__dict__.get("_args", ())
        body = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in self._public_state().items()])
        return f"{self._qualname.rsplit('.', 1)[-1]}({body})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __hash__(self) -> int:
        # by class and every plain field: stand-ins are dict keys in DCP metadata (MetadataIndex),
        # and a hash by class alone makes a dict of thousands of them quadratic; salted per process
        # so that a pickle cannot craft thousands of keys with one hash (quadratic again). Other
        # fields count by the values inside them, never hashed recursively: a field nested a
        # million deep or shared 2**40 times (a crafted key) costs at most HASH_VALUES steps, and
        # keys that collide hold few enough values for == to be cheap; a bigger one is no key
        parts: list[Any] = [_HASH_SALT, self._qualname]
        for name, value in self.__dict__.items():
            t = type(value)
            if t in _PLAIN:
                parts.append((name, value))
            elif not isinstance(value, _CONTAINERS):
                try:
                    parts.append((name, hash(value)))
                except TypeError:
                    continue
            elif isinstance(value, tuple) and len(value) <= 64 and set(map(type, value)) <= _PLAIN:
                parts.append((name, value))  # (a torch.Size, a flat tuple: hashed directly)
            else:
                parts.append((name, t.__name__, _values_inside(value)))
        return hash(tuple(parts))


def qualname_of(obj: Inert | type[Inert]) -> str:
    """The dotted name of the foreign class a stand-in (or a stand-in class) was rebuilt for; the
    attribute itself stays private: it is in the set of names a pickle may never set."""
    return obj._qualname


def public_state_of(obj: Inert) -> dict:
    """The pickled state a stand-in holds, without ckptkit's own bookkeeping."""
    return obj._public_state()


_INERT_ATTRS = frozenset(dir(Inert)) | {"_qualname"}
_PLAIN = frozenset({str, int, float, bool, type(None), bytes})
_CONTAINERS = (tuple, list, dict, set, frozenset, Inert)
HASH_VALUES = 4096  # the most values a stand-in used as a dictionary key may hold


def _values_inside(value: Any) -> int:
    """How many values a walk of `value` visits (shared parts each time), up to HASH_VALUES;
    TypeError (unhashable, as for a list in a frozen dataclass) beyond."""
    left = HASH_VALUES
    todo = [value]
    while todo:
        v = todo.pop()
        left -= 1
        if left < 0:
            raise TypeError("a stand-in holding this many values is no dictionary key")
        if isinstance(v, (tuple, list, set, frozenset)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, Inert):
            todo.extend(v.__dict__.values())
    return HASH_VALUES - left


_STR = {str}


def plain_attrs(state: Any, reserved: frozenset, what: str) -> dict:
    if type(state) is not dict or state.keys() & reserved or not set(map(type, state)) <= _STR:
        bad = next((k for k in state if type(k) is not str or k in reserved), None) if isinstance(state, dict) else None
        raise UnsafePickleError(
            f"refusing the state of {what}: attribute {quote(repr(bad), 60)} is not plain data (nothing was executed)"
        )
    return state


def apply_inert_state(obj: Inert, state: Any) -> None:
    """A stand-in's pickled state: a dict of plain attributes, a (dict, slots dict) pair, or any
    other value kept as `_state`; attributes never shadow the stand-in's own methods."""
    what = f"a {obj._qualname} stand-in"
    if isinstance(state, dict):
        obj.__dict__.update(plain_attrs(state, _INERT_ATTRS, what))
    elif (
        type(state) is tuple
        and len(state) == 2
        and all(p is None or isinstance(p, dict) for p in state)
        and any(isinstance(p, dict) for p in state)
    ):
        for part in state:
            if part:
                obj.__dict__.update(plain_attrs(part, _INERT_ATTRS, what))
    else:
        obj.__dict__["_state"] = state


def _inert_rebuild(qualname: str, args: tuple) -> Inert:
    return inert_class(qualname)(*args)


_INERT_CLASSES: dict[str, type] = {}


def inert_class(qualname: str) -> type:
    """The stand-in class for a foreign `module.Name` (one class per name, cached)."""
    cls = _INERT_CLASSES.get(qualname)
    if cls is None:
        cls = type(qualname.rsplit(".", 1)[-1], (Inert,), {"_qualname": qualname})
        _INERT_CLASSES[qualname] = cls
    return cls
