"""Stand-ins for the foreign classes a checkpoint pickles: plain data, never the class's code.

The restricted unpickler builds one for each class it allows as data (DCP metadata, DeepSpeed's
small state classes); torch_types.realize and repickle read them back. Kept apart from the
unpickler so that the stand-ins of torch's own types (torch_types), below it, can know them.
"""
from __future__ import annotations

import os
from typing import Any

_HASH_SALT = int.from_bytes(os.urandom(8), "little")


class Inert:
    """A foreign object rebuilt as plain data: constructor arguments and pickled state only."""

    _qualname = "Inert"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args
        if kwargs:
            self.__dict__["_kwargs"] = kwargs

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

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
        # by class and every hashable field: stand-ins are dict keys in DCP metadata (MetadataIndex),
        # and a hash by class alone makes a dict of thousands of them quadratic; salted per process
        # so that a pickle cannot craft thousands of keys with one hash (quadratic again)
        parts: list[Any] = [_HASH_SALT, self._qualname]
        for name, value in self.__dict__.items():
            try:
                parts.append((name, hash(value)))
            except TypeError:
                continue
        return hash(tuple(parts))


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
