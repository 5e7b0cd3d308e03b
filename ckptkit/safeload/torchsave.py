"""A torch.save archive's data.pkl, read lazily at C speed: Python's C unpickler, fenced in.

A DeepSpeed ZeRO-3 model-states file of 20k parameters pickles 40k tensors (20k of them empty
placeholders) and their shapes: ckptkit's own pickle machine (safeload.vm) takes ~1 s for it,
Python's C unpickler 0.3 s. It runs inside safeload.fence's fences (the opcodes scanned first,
floats and persistent ids allowed here; only the grammar's own values and rules for torch's
rebuild functions, tensor classes, torch.Size, dtypes, layouts, memory formats, devices, legacy
storage types, OrderedDict and the inert stand-ins, DeepSpeed's among them), and this road adds
one more on the result, else `load` hands back None and the restricted machine reads it:

- a walk of the result: only plain data (dicts, lists, tuples, OrderedDicts whose attributes
  shadow none of their own, stand-ins, strings, numbers, None) and what the rules made
  (TensorRefs, storages, Sizes, dtypes and globals: each refuses a state, so none was changed
  after its rule checked it); nested well within the machine's depth limit; walked as a full
  walk of the result would, shared parts each time they are reached, within a budget of about
  one container per input byte (so nothing expands, and a value containing itself is declined).

Lazy loads only (tensors as TensorRefs): eager loads build bytes, which the machine counts.
What it returns equals what the machine builds from the same bytes (tests/test_safeload_torchsave.py).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from .. import knobs
from .fence import Call, Decline, SizeCall, run
from .grammar import ORDERED_DICT_ATTRS, RestrictedGrammar, rebuild_from_type_v2_marker, table
from .inert import Inert, plain_attrs
from .refs import StorageRef, TensorRef, StorageType, TypedStorage
from .rules import extra_allowed
from ..torch_types import DType, GlobalRef, Size

__all__ = ["load"]

# the modules whose globals the road serves (numpy, builtins, codecs, copyreg, pathlib: the machine)
_MODULES = {
    "torch",
    "torch._utils",
    "torch._tensor",
    "torch.nn.parameter",
    "torch.serialization",
    "torch.storage",
    "collections",
    "argparse",
}
_LEAVES = frozenset(
    {str, int, float, bool, type(None), DType, GlobalRef, Size, TensorRef, StorageRef, TypedStorage, StorageType}
)
# the walk's depth limit: the machine counts the depth of a rebuilt value's arguments too
_DEPTH_MARGIN = 16


class _FromTypeCall(Call):
    """torch._tensor._rebuild_from_type_v2(func, new_type, args, state): the grammar's own check,
    with the rebuild function as the grammar knows it (here it arrives as its Call)."""

    __slots__ = ()

    def __call__(self, *args: Any) -> Any:
        if len(args) == 4 and isinstance(args[0], Call):
            args = (args[0].rule, *args[1:])
        return Call.__call__(self, *args)


_NAMES: dict[tuple[str, str], Any] | None = None


def _names() -> dict[tuple[str, str], Any]:
    global _NAMES
    if _NAMES is None:
        values, calls = table()
        grammar = RestrictedGrammar("", None)
        found: dict[tuple[str, str], Any] = {}
        for (module, name), value in values.items():
            if module not in _MODULES:
                continue
            entry = calls.get(id(value))
            if value is rebuild_from_type_v2_marker:
                found[(module, name)] = _FromTypeCall(grammar.rebuild_from_type_v2)
            elif entry is None:
                found[(module, name)] = value  # stand-in classes, dtypes, globals, storage types
            else:  # rebuild functions, torch.Size, torch.device, _get_layout, OrderedDict ...
                found[(module, name)] = SizeCall(entry[1]) if value is Size else Call(entry[1])
        _NAMES = found
    return _NAMES


def _check(value: Any, budget: int) -> None:
    """The walk of the result (see the module docstring); raises Decline. A container reached
    again is walked again: the walk visits what a full walk of the result visits, so `budget`
    visits bound its expanded size (and end a cycle)."""
    limit = knobs.MAX_PICKLE_DEPTH - _DEPTH_MARGIN
    todo: list[tuple[Any, int]] = [(value, 0)]
    pop, push = todo.pop, todo.append
    leaves = _LEAVES
    while todo:
        v, depth = pop()
        t = type(v)
        if t in leaves:
            continue
        budget -= 1
        if depth > limit or budget < 0:
            raise Decline
        depth += 1
        if t is dict or t is collections.OrderedDict:
            if t is not dict:
                attrs = v.__dict__  # torch's state_dict()._metadata, set by BUILD
                if attrs:
                    push((plain_attrs(attrs, ORDERED_DICT_ATTRS, "an OrderedDict"), depth))  # (the grammar's check)
            for k, x in v.items():
                if type(k) not in leaves:
                    push((k, depth))
                if type(x) not in leaves:
                    push((x, depth))
        elif t is list or t is tuple:
            for x in v:
                if type(x) not in leaves:
                    push((x, depth))
        elif isinstance(v, Inert):
            push((v.__dict__, depth))
        else:
            raise Decline


# containers a walk may reach beyond one per input byte: what torch.save's pickles share (the
# `betas` list every param group of an optimizer holds) is reached again
_SHARED = 100_000


def load(data: bytes, persistent_load: Callable[[Any], Any]) -> Any | None:
    """The value a torch.save data.pkl pickles, tensors as TensorRefs (`persistent_load` gives the
    storages), or None where the fast road does not take it (the caller runs the machine then)."""
    names = _names()
    extra = extra_allowed()
    if any(key in names for key in extra):
        return None  # a format re-mapped one of these globals: only the grammar knows what to build
    if extra:
        names = {
            **names,
            **{key: value for key, value in extra.items() if isinstance(value, type) and issubclass(value, Inert)},
        }
    budget = len(data) + _SHARED  # (every container costs its pickle a byte at least)
    return run(data, names, lambda value: _check(value, budget), floats=True, persistent_load=persistent_load)
