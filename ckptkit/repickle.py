"""Pickling that re-emits inert stand-ins as the classes they stand for.

The restricted unpickler rebuilds foreign objects (DeepSpeed's LossScaler, ZeroStageEnum, DCP
metadata classes, ...) as data-only stand-ins. When ckptkit writes a checkpoint another
framework will load, those objects must come back as the original classes: this pickler writes
a GLOBAL opcode naming the original module and class, followed by the same constructor
arguments (REDUCE) or none (NEWOBJ) and the same state (BUILD) - without importing the foreign
module. torch's small types stand-ins (torch.Size, dtypes, ckptkit.torch_types) are written as
pickle writes the real ones, so writing needs no torch. Tensors go through `persistent_id` like
torch.save's own pickler.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Callable

from .safeload import Inert, inert_class
from .torch_types import DType, GlobalRef, Size

__all__ = ["FaithfulPickler", "GlobalRef", "dumps", "stand_in", "stand_in_call"]
_TORCH_SIZE = GlobalRef("torch", "Size")


class FaithfulPickler(pickle._Pickler):  # the pure-Python pickler lets us write opcodes directly
    def __init__(self, file: io.BytesIO, protocol: int = 2,
                 persistent_id: Callable[[Any], Any] | None = None,
                 reduce_hook: Callable[[Any], Any] | None = None) -> None:
        super().__init__(file, protocol=protocol)
        self._pid = persistent_id
        self._reduce_hook = reduce_hook

    def persistent_id(self, obj: Any) -> Any:  # noqa: D401 - pickle protocol
        return self._pid(obj) if self._pid is not None else None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, GlobalRef):
            self._save_global_ref(obj)
            return
        if isinstance(obj, DType):  # torch.float32 pickles as the global itself
            self._save_global_ref(GlobalRef("torch", obj.attr))
            return
        if type(obj) is Size:  # torch.Size pickles as torch.Size(tuple)
            self._save_memoized_reduce(obj, _TORCH_SIZE, (tuple(obj),))
            return
        if isinstance(obj, Inert):
            self._save_inert(obj)
            return
        if self._reduce_hook is not None and save_persistent_id:
            rv = self._reduce_hook(obj)
            if rv is not None:
                x = self.memo.get(id(obj))
                if x is not None:
                    self.write(self.get(x[0]))
                    return
                self.save_reduce(obj=obj, *rv)
                return
        super().save(obj, save_persistent_id)

    def _save_global_ref(self, ref: GlobalRef) -> None:
        x = self.memo.get(id(ref))  # once per pickle, then a memo reference, as pickle does for globals
        if x is not None:
            self.write(self.get(x[0]))
            return
        self.write(pickle.GLOBAL + f"{ref.module}\n{ref.name}\n".encode("utf-8"))
        self.memoize(ref)

    def _save_memoized_reduce(self, obj: Any, func: GlobalRef, args: tuple) -> None:
        x = self.memo.get(id(obj))
        if x is not None:
            self.write(self.get(x[0]))
            return
        self.save_reduce(func, args, obj=obj)

    def _save_inert(self, obj: Inert) -> None:
        x = self.memo.get(id(obj))
        if x is not None:
            self.write(self.get(x[0]))
            return
        module, _, name = obj._qualname.rpartition(".")
        self._save_global_ref(GlobalRef(module, name))
        if "_args" in obj.__dict__:  # built by calling the class (REDUCE), e.g. an Enum member
            self.save(tuple(obj.__dict__["_args"]))
            self.write(pickle.REDUCE)
        else:  # built by cls.__new__(cls) (NEWOBJ), e.g. a plain object or dataclass
            self.save(())
            self.write(pickle.NEWOBJ)
        self.memoize(obj)
        state = obj.__dict__.get("_state", obj._public_state())
        if state or "_state" in obj.__dict__:
            self.save(state)
            self.write(pickle.BUILD)


def stand_in(qualname: str, **state: Any) -> Inert:
    """A new object of a foreign class built like a dataclass (NEWOBJ, then BUILD with `state`;
    `_state=x` gives a non-dict state, as a class with __getstate__ pickles it)."""
    cls = inert_class(qualname)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def stand_in_call(qualname: str, *args: Any) -> Inert:
    """A new foreign object pickled as a call (REDUCE): an Enum member, torch's _get_layout(...)."""
    obj = stand_in(qualname)
    obj.__dict__["_args"] = args
    return obj


def dumps(obj: Any, protocol: int = 2, persistent_id: Callable[[Any], Any] | None = None,
          reduce_hook: Callable[[Any], Any] | None = None) -> bytes:
    buf = io.BytesIO()
    FaithfulPickler(buf, protocol, persistent_id, reduce_hook).dump(obj)
    return buf.getvalue()
