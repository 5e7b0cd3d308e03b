"""Which tensors of a checkpoint are the model, which the optimizer, which something else.

Decided from the original nesting (paths), never by splitting keys on ".": a checkpoint saved
as {"model": ..., "optim": ...} has its model under the "model" container (dropped from the
output names); torchtitan-style checkpoints keep model keys at the top level.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from ..index.flatten import key_of
from ..index.types import CheckpointIndex
from ..lazy_torch import is_tensor
from ..torch_types import SmallTensor

MODEL_CONTAINERS = ("model", "module", "state_dict", "model_state_dict")
OPTIM_CONTAINERS = ("optim", "optimizer", "optimizers", "optim_state", "optimizer_state",
                    "optimizer_state_dict", "opt")
OTHER_CONTAINERS = ("extra", "lr_scheduler", "scheduler", "dataloader", "train_state", "rng",
                    "rng_state", "client_state", "trainer", "args", "config")
LOW_PRECISION_CONTAINERS = ("ds_module",)  # DeepSpeed's low-precision copies of the fp32 masters
BARE_OPTIMIZER_KEYS = frozenset({"state", "param_groups"})  # what torch.optim's state_dict() holds
STEP_NAMES = ("step", "global_step", "global_steps", "train_step", "iteration", "iter")


@dataclass
class Split:
    """Output name -> index key, per role."""

    model: dict[str, str] = field(default_factory=dict)
    optim: dict[str, str] = field(default_factory=dict)
    optim_objects: dict[str, str] = field(default_factory=dict)
    other: list[str] = field(default_factory=list)
    low_precision: list[str] = field(default_factory=list)
    container: str | None = None


def split_roles(index: CheckpointIndex) -> Split:
    split = Split()
    heads = {e.path[0] for e in list(index.tensors.values()) + list(index.objects.values())
             if e.path and len(e.path) > 1}
    container = next((c for c in MODEL_CONTAINERS if c in heads), None)
    split.container = container
    # a bare optimizer.state_dict() saved on its own (torch.save(opt.state_dict(), "optimizer.pt"))
    bare_optimizer = container is None and "param_groups" in heads and heads <= BARE_OPTIMIZER_KEYS
    for key, e in index.tensors.items():
        path = e.path if e.path else (key,)
        head = path[0] if len(path) > 1 else None
        if e.attrs.get("role") == "optimizer" or bare_optimizer:  # e.g. optimizer*.safetensors by consolidate
            split.optim[key] = key
        elif container is not None and head == container:
            split.model[key_of(path[1:])] = key
        elif head in OPTIM_CONTAINERS:
            split.optim[key_of(path[1:])] = key
        elif head in LOW_PRECISION_CONTAINERS:
            split.low_precision.append(key)
        elif container is None and head not in OTHER_CONTAINERS:
            split.model[key] = key
        else:
            split.other.append(key)
    for key, o in index.objects.items():
        path = o.path if o.path else (key,)
        if o.attrs.get("role") == "optimizer" or bare_optimizer:
            split.optim_objects[key] = key
        elif len(path) > 1 and path[0] in OPTIM_CONTAINERS:
            split.optim_objects[key_of(path[1:])] = key
    return split


def guess_step(index: CheckpointIndex) -> int | None:
    """The training step, if the checkpoint records one outside the optimizer state."""
    candidates = []
    for key, o in index.objects.items():
        path = o.path or (key,)
        if path[-1] in STEP_NAMES and (len(path) == 1 or path[0] not in OPTIM_CONTAINERS):
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
