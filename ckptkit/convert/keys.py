"""Which tensors of a checkpoint are the model, which the optimizer, which something else.

Decided from the original nesting (paths), never by splitting keys on ".": a checkpoint saved
as {"model": ..., "optim": ...} has its model under the "model" container (dropped from the
output names); torchtitan-style checkpoints keep model keys at the top level.

Optimizer containers come in three shapes: a named one ("optim", "optimizer", ...), Lightning's
numbered slots in DCP (`optimizer_0`, `optimizer_1`: one per optimizer) and Lightning's list in a
single file (`optimizer_states`: [state_dict, ...]). Below the container, names are canonical:
`state.<param>.<key>` and `param_groups.<g>.<hyper>`; with several optimizers each keeps its
slot in front (`optimizer_1.state...`). State keyed by parameter NUMBER (torch's own
optimizer.state_dict(), Lightning's .ckpt) gets names only where formats/lightning.py's rule
proves them; otherwise it stays numbered and `Split.numbered` says why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..formats import lightning
from ..index.flatten import key_of
from ..index.types import CheckpointIndex
from ..lazy_torch import is_tensor
from ..runner.stream import find_aliases
from ..torch_types import SmallTensor


class ContainerNames(tuple):
    """Fixed container names plus a family matched by a pattern: `"optimizer_1" in OPTIM_CONTAINERS`
    is True, so every `head in OPTIM_CONTAINERS` test knows Lightning's numbered slots."""

    pattern: re.Pattern

    def __new__(cls, names: tuple[str, ...], pattern: str) -> "ContainerNames":
        obj = super().__new__(cls, names)
        obj.pattern = re.compile(pattern)
        return obj

    def __contains__(self, item: object) -> bool:
        return tuple.__contains__(self, item) or (isinstance(item, str) and bool(self.pattern.match(item)))


MODEL_CONTAINERS = ("model", "module", "state_dict", "model_state_dict")
OPTIM_LISTS = ("optimizer_states",)  # Lightning's single file: a list of optimizer state dicts
# Lightning's FSDP/DCP layout has one container per optimizer: optimizer_0, optimizer_1, ...
OPTIM_CONTAINERS = ContainerNames(
    ("optim", "optimizer", "optimizers", "optim_state", "optimizer_state", "optimizer_state_dict", "opt") + OPTIM_LISTS,
    r"^optimizer_\d+$",
)
OTHER_CONTAINERS = (
    "extra",
    "lr_scheduler",
    "scheduler",
    "dataloader",
    "train_state",
    "rng",
    "rng_state",
    "client_state",
    "trainer",
    "args",
    "config",
    # Lightning's checkpoint dict
    "lr_schedulers",
    "loops",
    "callbacks",
    "hyper_parameters",
    "datamodule_hyper_parameters",
)
LOW_PRECISION_CONTAINERS = ("ds_module",)  # DeepSpeed's low-precision copies of the fp32 masters
BARE_OPTIMIZER_KEYS = frozenset({"state", "param_groups"})  # what torch.optim's state_dict() holds
STEP_NAMES = ("step", "global_step", "global_steps", "train_step", "iteration", "iter")


def is_optim_container(head: Any) -> bool:
    """True for a top-level name that holds optimizer state (`optim`, `optimizer_0`, `optimizer_states`...)."""
    return isinstance(head, str) and head in OPTIM_CONTAINERS


def optimizer_parts(path: tuple) -> tuple[str, tuple] | None:
    """(the optimizer's slot, the path below it) for optimizer state, else None.

    The slot is the container's name, or `optimizer_<i>` for entry i of Lightning's
    `optimizer_states` list, so both of Lightning's layouts name an optimizer alike."""
    if len(path) < 2:
        return None
    head = path[0]
    if head in OPTIM_LISTS:
        if len(path) < 3 or not isinstance(path[1], int):
            return None
        return f"optimizer_{path[1]}", tuple(path[2:])
    if isinstance(head, str) and head in OPTIM_CONTAINERS:
        return head, tuple(path[1:])
    return None


@dataclass
class Split:
    """Output name -> index key, per role."""

    model: dict[str, str] = field(default_factory=dict)
    optim: dict[str, str] = field(default_factory=dict)
    optim_objects: dict[str, str] = field(default_factory=dict)
    other: list[str] = field(default_factory=list)
    low_precision: list[str] = field(default_factory=list)
    container: str | None = None
    # per-parameter optimizer entries: output name -> (slot prefix, parameter name, state key)
    optim_params: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    # optimizer values whose output differs from the stored one (a `params` list given names)
    optim_values: dict[str, Any] = field(default_factory=dict)
    # optimizer slots keyed by parameter number: slot -> why the numbers were not given names
    numbered: dict[str, str] = field(default_factory=dict)
    # slots whose numbers were given names by formats/lightning.py's rule
    named_by_order: list[str] = field(default_factory=list)


def _is_number(part: Any) -> bool:
    return isinstance(part, int) or (isinstance(part, str) and part.isdigit())


def _head_role(head: Any, container: str | None) -> str:
    """Where a tensor whose path starts with `head` (and goes deeper) belongs, before its role
    attribute and the optimizer's list entries are looked at: split_roles' order of tests."""
    if container is not None and head == container:
        return "model_below"
    if head in OPTIM_LISTS:
        return "optim_list"
    if isinstance(head, str) and head in OPTIM_CONTAINERS:
        return "optim"
    if head in LOW_PRECISION_CONTAINERS:
        return "low_precision"
    if container is None and head not in OTHER_CONTAINERS and head not in OPTIM_CONTAINERS:
        return "model"
    return "other"


def split_roles(index: CheckpointIndex) -> Split:
    split = Split()
    heads = {
        e.path[0] for entries in (index.tensors, index.objects) for e in entries.values() if e.path and len(e.path) > 1
    }
    container = next((c for c in MODEL_CONTAINERS if c in heads), None)
    split.container = container
    # a bare optimizer.state_dict() saved on its own (torch.save(opt.state_dict(), "optimizer.pt"))
    bare_optimizer = container is None and "param_groups" in heads and heads <= BARE_OPTIMIZER_KEYS
    optim_tensors: list[tuple[str, str, tuple]] = []  # (index key, slot, path below the slot)
    optim_objects: list[tuple[str, str, tuple]] = []
    model, optim, other, low = split.model, split.optim, split.other, split.low_precision
    single = "model" if container is None else "other"  # a path of one part
    roles: dict[str, str] = {}  # head (a str) -> _head_role: a few heads for every tensor
    for key, e in index.tensors.items():  # per tensor: kept lean
        if bare_optimizer or e.attrs.get("role") == "optimizer":  # e.g. optimizer*.safetensors by consolidate
            optim[key] = key
            continue
        path = e.path
        if not path or len(path) == 1:
            if single == "model":
                model[key] = key
            else:
                other.append(key)
            continue
        head = path[0]
        if type(head) is str:
            role = roles.get(head)
            if role is None:
                role = roles[head] = _head_role(head, container)
        else:
            role = _head_role(head, container)
        if role == "model_below":
            below = path[1] if len(path) == 2 else None
            model[below if type(below) is str else key_of(path[1:])] = key
        elif role == "optim":
            optim_tensors.append((key, head, tuple(path[1:])))
        elif role == "optim_list":
            parts = optimizer_parts(tuple(path))
            if parts is not None:
                optim_tensors.append((key, *parts))
            else:
                other.append(key)  # a name in OPTIM_CONTAINERS: never a model tensor
        elif role == "low_precision":
            low.append(key)
        elif role == "model":
            model[key] = key
        else:
            other.append(key)
    for key, o in index.objects.items():
        path = o.path if o.path else (key,)
        parts = optimizer_parts(tuple(path))
        if o.attrs.get("role") == "optimizer" or bare_optimizer:
            split.optim_objects[key] = key
        elif parts is not None:
            optim_objects.append((key, *parts))
    _name_optimizer(index, split, optim_tensors, optim_objects)
    return split


def _name_optimizer(
    index: CheckpointIndex, split: Split, tensors: list[tuple[str, str, tuple]], objects: list[tuple[str, str, tuple]]
) -> None:
    """Canonical names below each optimizer slot; numbers become names where that is proven."""
    slots = list(dict.fromkeys([slot for _, slot, _ in tensors] + [slot for _, slot, _ in objects]))
    names = {slot: _slot_names(index, split, slot, tensors, objects) for slot in slots}
    prefix = "" if len(slots) <= 1 else None  # None: each slot's own `<slot>.`
    optim_params = split.optim_params
    for entries, target in ((tensors, split.optim), (objects, split.optim_objects)):
        is_objects = target is split.optim_objects
        for key, slot, rest in entries:  # per tensor: kept lean
            pre = f"{slot}." if prefix is None else prefix
            mapping = names[slot]
            if len(rest) >= 3 and rest[0] == "state":
                param = rest[1]
                param = param if type(param) is str else str(param)
                if mapping and param.isdigit():
                    param = mapping.get(int(param), param)
                statekey = rest[2] if len(rest) == 3 and type(rest[2]) is str else key_of(rest[2:])
                name = f"{pre}state.{param}.{statekey}"
                optim_params[name] = (pre, param, statekey)
            else:
                name = pre + key_of(rest)
                value = index.objects[key].data if is_objects else None
                if (
                    mapping
                    and len(rest) == 3
                    and rest[0] == "param_groups"
                    and rest[2] == "params"
                    and isinstance(value, list)
                ):
                    split.optim_values[name] = [mapping.get(v, v) if isinstance(v, int) else v for v in value]
            target[name] = key


def _slot_names(index: CheckpointIndex, split: Split, slot: str, tensors: list, objects: list) -> dict[int, str]:
    """number -> name for one optimizer slot keyed by number (empty when keyed by name or unproven)."""
    state = []
    for entries in (tensors, objects):
        for key, s, rest in entries:
            if s == slot and len(rest) >= 3 and rest[0] == "state":
                if not _is_number(rest[1]):
                    return {}  # keyed by name
                state.append((key, rest))
    if not state:
        return {}
    groups: dict[int, Any] = {}
    for key, s, rest in objects:
        if s == slot and len(rest) == 3 and rest[0] == "param_groups" and rest[2] == "params" and _is_number(rest[1]):
            groups[int(rest[1])] = index.objects[key].data
    where = f"optimizer state {slot}"
    if not lightning.is_lightning(index):
        split.numbered[slot] = (
            f"{where} is keyed by parameter number, and only Lightning's checkpoints "
            f"are given names from the model's order"
        )
        return {}
    shapes: dict[int, dict[str, tuple[int, ...]]] = {}
    for key, rest in state:
        if key in index.tensors:
            shapes.setdefault(int(rest[1]), {})[key_of(rest[2:])] = tuple(index.tensors[key].shape)
    model = {name: index.tensors[key] for name, key in split.model.items()}
    numbering = lightning.number_names([groups[g] for g in sorted(groups)], model, find_aliases(model), shapes, where)
    if numbering.names is None:
        split.numbered[slot] = numbering.why
        return {}
    split.named_by_order.append(slot)
    return numbering.names


def guess_step(index: CheckpointIndex) -> int | None:
    """The training step, if the checkpoint records one outside the optimizer state
    (Lightning's global_step first, where the checkpoint is Lightning's)."""
    step = lightning.global_step(index)
    if step is not None:
        return step
    candidates = []
    for key, o in index.objects.items():
        path = o.path or (key,)
        if path[-1] in STEP_NAMES and (len(path) == 1 or not is_optim_container(path[0])):
            candidates.append(o.data)
    for value in candidates:
        if isinstance(value, SmallTensor) and value.numel == 1:
            value = (value.tolist() or [None])[0]
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if is_tensor(value) and value.numel() == 1:
            return int(value.item())
    return None
