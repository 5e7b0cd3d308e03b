"""What a Checkpointer step holds besides the model and optimizer: `extra` (what save() was
given, tensors included) and `states` (each named object's state_dict(), one per rank), read
back as nested values from the checkpoint's index. Before a step is written, every value that
is no tensor is checked to be one the restricted loader gives back (`check_restorable`): a step
restore would refuse must never be committed, or retention could delete the restorable ones."""

from __future__ import annotations

import io
from typing import Any

from ..errors import CkptkitError, UsageError
from ..index.flatten import Path, unflatten
from ..index.types import CheckpointIndex

STATES = "states"


def rank_key(rank: int) -> str:
    return f"rank_{rank}"


def has_prefix(index: CheckpointIndex, prefix: tuple[str, ...]) -> bool:
    n = len(prefix)
    return any(
        path_of(e.path, e.key)[:n] == prefix
        for entries in (index.tensors.values(), index.objects.values())
        for e in entries
    )


def template(index: CheckpointIndex, prefix: tuple[str, ...]) -> dict | None:
    """A state dict shaped like the entries under `prefix` (empty tensors of the saved dtype and
    shape, None for other values) for `ckptkit.load` to fill; None when there are none."""
    import torch

    from ..index.dtypes import torch_dtype

    n = len(prefix)
    items: list[tuple[tuple, Any]] = []
    for t in index.tensors.values():
        path = path_of(t.path, t.key)
        if path[:n] == prefix:
            items.append((path[n:], torch.empty(tuple(t.shape), dtype=torch_dtype(t.dtype))))
    for o in index.objects.values():
        path = path_of(o.path, o.key)
        if path[:n] == prefix:
            items.append((path[n:], None))
    return unflatten(items) if items else None


def path_of(path: tuple | None, key: str) -> tuple:
    """An entry's nesting; its key split on dots where the index did not record one."""
    return tuple(path) if path else tuple(key.split("."))


EXTRA_HOLDS = "dicts, lists, tuples, str, int, float, bool, None and tensors"
_HOLD = f"extra (and each state_dict() of states) may hold {EXTRA_HOLDS}"


def check_restorable(leaves: list[tuple[Path, Any]]) -> None:
    """Refuse (a UsageError naming the entry and its type) a value that is no tensor and that
    restore could not read back: one that cannot be pickled (a lambda), or whose pickle ckptkit's
    restricted loader refuses (a Fraction, any class of your own). Each is pickled as DCP writes
    it (torch.save of the value alone) and run through the loader the reader uses."""
    import torch

    from ..api import spell
    from ..runner.torch_archive import load_bytes_archive

    for path, value in leaves:
        if isinstance(value, torch.Tensor) or plain(value):
            continue
        name = f"{path[0]}{spell(path[2:] if path[0] == STATES else path[1:])}"  # states: not the rank
        buf = io.BytesIO()
        try:
            torch.save(value, buf)
        except Exception as exc:  # pickling runs user code (__reduce__): any error is the value's
            raise UsageError(
                f"{name}: a {type(value).__name__} cannot be saved ({_first_line(exc)}); {_HOLD}"
            ) from None
        try:
            load_bytes_archive(buf.getvalue(), name)
        except CkptkitError as exc:
            raise UsageError(
                f"{name}: a {type(value).__name__} would be saved that restore refuses "
                f"({_first_line(exc).removeprefix(name + ': ')}); {_HOLD}"
            ) from None


PLAIN_SCALARS = (str, int, float, bool, type(None))


def plain(value: Any, depth: int = 0) -> bool:
    """Whether `value` is made of builtins alone (exactly str, int, float, bool, None, and lists,
    tuples and str-keyed dicts of them), which the restricted loader always gives back: an
    optimizer's hyperparameters, a step counter. Such values skip the pickling round trip, which
    would otherwise cost every save a torch.save and a load per value."""
    if type(value) in PLAIN_SCALARS:
        return True
    if depth > 20:
        return False
    if type(value) in (list, tuple):
        return all(plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(type(k) is str and plain(v, depth + 1) for k, v in value.items())
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
