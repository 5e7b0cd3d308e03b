"""PyTorch Lightning's checkpoints: what Lightning adds around the model and the optimizer.

Lightning writes its checkpoint dict ({"state_dict", "optimizer_states", "lr_schedulers",
"global_step", "epoch", "loops", "callbacks", "hyper_parameters", ...}) in three layouts:

  single file   torch.save of the whole dict (.ckpt); "optimizer_states" is a list of
                optimizer.state_dict()s, keyed by parameter NUMBER
  FSDP sharded  FSDPStrategy(state_dict_type="sharded").save_checkpoint: a DCP folder of
                {"model": state_dict, "optimizer_0": ..., "optimizer_1": ...} (optimizer state
                keyed by parameter name) and `meta.pt`, a torch.save of every other key
  DeepSpeed     DeepSpeedStrategy.save_checkpoint: engine.save_checkpoint(tag="checkpoint") with
                the dict less "state_dict" and "optimizer_states" as client_state

This module reads `meta.pt` (through the restricted unpickler, like every file), finds Lightning's
step, maps numbered optimizer state to names where that is provable, and says which attribute
prefix of the LightningModule (`self.model` -> `model.`) to strip for the model's own names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..errors import CkptkitError, quote
from ..index.types import CheckpointIndex, TensorEntry
from ..storage.source import Source

META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
VERSION_KEY = "pytorch-lightning_version"  # written by every Lightning checkpoint
STEP_PATHS = (("global_step",), ("client", "global_step"))  # .ckpt / meta.pt; DeepSpeed client state
OLD_WRAPPER = "_forward_module."  # DeepSpeed names of Lightning < 2.1 (_LightningModuleWrapperBase)
META_ATTR = "lightning_meta"  # attrs mark on entries read from meta.pt


def add_meta(source: Source, index: CheckpointIndex) -> None:
    """Merge a DCP folder's `meta.pt` into its index (entries marked attrs["lightning_meta"]).

    A meta.pt the restricted unpickler refuses (a hyperparameter of a class it does not know, say)
    does not stop the model and optimizer from being read: the sentence is kept in
    index.metadata["unread"] for every command to show, and nothing of meta.pt is indexed."""
    if META not in source.listdir("") or source.isdir(META):
        return
    from .torch_save import reader as ts_reader

    info = index.metadata.setdefault("lightning", {})
    info["layout"] = "fsdp_sharded"
    info["meta"] = META
    try:
        meta = ts_reader.read_index(source, META)
    except CkptkitError as e:
        from ..index import problems

        problems.tolerate(e, source.label(META))  # verify lists it among the problems; others say it in a note
        index.metadata.setdefault("unread", {})[META] = (
            f"{e} (Lightning's step, loops, callbacks and scheduler state in it are not read; the model "
            f"and optimizer in the DCP files are)"
        )
        index.files[META] = source.size(META)
        return
    taken = set(index.tensors) | set(index.objects)
    for key, e in list(meta.tensors.items()) + list(meta.objects.items()):
        if key in taken:  # a DCP key and a meta.pt key that flatten alike: keep meta.pt's apart
            key = f"{META}:{key}"
            e.key = key
        e.attrs[META_ATTR] = True
        (index.add_tensor if isinstance(e, TensorEntry) else index.add_object)(e)
    index.files.update(meta.files)
    index.checks.extend(meta.checks)


DEFAULT_STRIP_KEY = "default_strip_prefixes"  # read by ops/consolidate.key_rules when no rule is given
MODEL_CONTAINERS = ("state_dict", "model")  # single file; DCP ("model") and ckptkit's DeepSpeed index


def annotate(index: CheckpointIndex) -> None:
    """Mark a Lightning checkpoint: index.metadata["lightning"] (layout, model prefix), and the
    LightningModule attribute prefix as the default name rule for weights-only outputs."""
    if not is_lightning(index):
        return
    info = index.metadata.setdefault("lightning", {})
    if "layout" not in info:
        info["layout"] = {"deepspeed": "deepspeed", "dcp": "fsdp_sharded"}.get(index.format, "single_file")
    heads = {e.path[0] for e in index.tensors.values() if e.path and len(e.path) > 1}
    container = next((c for c in MODEL_CONTAINERS if c in heads), None)
    if container is None:
        return
    names = [
        ".".join(str(p) for p in e.path[1:])
        for e in index.tensors.values()
        if e.path and len(e.path) > 1 and e.path[0] == container
    ]
    prefix = model_prefix(names)
    if prefix is not None:
        info["model_prefix"] = prefix
        index.metadata.setdefault(DEFAULT_STRIP_KEY, [prefix])


def dcp_part(index: CheckpointIndex, source: Source | None = None) -> tuple[CheckpointIndex, list[str]]:
    """A Lightning FSDP folder as a writer of the same kind needs it: the index of its DCP part
    (meta.pt's entries left out) and the entries to copy byte for byte beside it: meta.pt first,
    then, given the `source`, every other entry of the folder that is not a DCP file (sorted).

    Lightning loads such a folder only with its meta.pt (`_is_sharded_checkpoint`), so a reshard
    writes the DCP part for the new world size and copies meta.pt as it is; nothing else in the
    folder is left behind silently. ([] to copy: not a Lightning FSDP folder.)"""
    if (index.metadata.get("lightning") or {}).get("meta") != META:
        return index, []
    part = dataclasses.replace(
        index,
        tensors={k: e for k, e in index.tensors.items() if not e.attrs.get(META_ATTR)},
        objects={k: o for k, o in index.objects.items() if not o.attrs.get(META_ATTR)},
        files={k: v for k, v in index.files.items() if k != META},
        checks=[c for c in index.checks if c.file != META],
    )
    others = sorted(n for n in source.listdir("") if n != META and n not in part.files) if source else []
    return part, [META, *others]


def is_lightning(index: CheckpointIndex) -> bool:
    """True for a checkpoint Lightning wrote (its version key, or a meta.pt beside a DCP folder)."""
    if "lightning" in index.metadata:
        return True
    return any((o.path or (k,)) in ((VERSION_KEY,), ("client", VERSION_KEY)) for k, o in index.objects.items())


def global_step(index: CheckpointIndex) -> int | None:
    """Lightning's trainer.global_step, where the checkpoint records it."""
    for k, o in index.objects.items():
        if tuple(o.path or (k,)) in STEP_PATHS and isinstance(o.data, int) and not isinstance(o.data, bool):
            return o.data
    return None


def model_prefix(names: Sequence[str]) -> str | None:
    """The LightningModule attribute every model name starts with (`self.model` -> "model."),
    after Lightning < 2.1's DeepSpeed wrapper mark; None when the names do not all share one.

    A LightningModule's state_dict names its network through the attribute holding it; the
    network's own names (what from_pretrained expects) are what follows."""
    wrapped = bool(names) and all(n.startswith(OLD_WRAPPER) for n in names)
    bare = [n[len(OLD_WRAPPER) :] if wrapped else n for n in names]
    if not bare or any("." not in n for n in bare):
        return None
    first = {n.split(".", 1)[0] for n in bare}
    if len(first) != 1:
        return None
    return (OLD_WRAPPER if wrapped else "") + first.pop() + "."


@dataclasses.dataclass
class Numbering:
    """How one optimizer's parameter numbers relate to the model's names."""

    names: dict[int, str] | None  # number -> name, when proven
    why: str = ""  # when not: one sentence saying what is missing


def number_names(
    group_params: list[Any],
    model: dict[str, TensorEntry],
    aliases: dict[str, str],
    state_shapes: dict[int, dict[str, tuple[int, ...]]],
    where: str,
) -> Numbering:
    """Map an optimizer's parameter numbers to model names, only where the file proves it.

    torch numbers parameters in the order they were given to the optimizer, which the file does
    not record. The order is taken as the model's own (its state_dict order, tied copies once)
    only when ALL hold:
      1. one param group, listing 0..N-1 in order (with several groups, which parameter went into
         which group was the training code's choice);
      2. N equals the number of model tensors (so every model tensor is a trained parameter: no
         buffer, no frozen parameter, nothing left out that would shift the numbers);
      3. every state tensor that is not 0-d (exp_avg, momentum_buffer, ...) has exactly the shape of
         the model tensor at its number.
    Anything else keeps the numbers, with the reason."""
    order = [n for n in model if n not in aliases]
    if len(group_params) != 1:
        return Numbering(
            None,
            f"{where} has {len(group_params)} param groups listing parameters by number, "
            f"and which parameter went into which group is not recorded",
        )
    numbers = group_params[0]
    if not isinstance(numbers, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        return Numbering(None, f"{where}: its param group does not list parameter numbers")
    if numbers != list(range(len(numbers))):
        return Numbering(None, f"{where}: its param group does not list the numbers 0..{len(numbers) - 1} in order")
    if len(numbers) != len(order):
        return Numbering(
            None,
            f"{where} numbers {len(numbers)} parameters and the model has {len(order)} tensors, "
            f"so the model's order does not prove which is which (buffers or frozen "
            f"parameters shift it)",
        )
    for number, states in state_shapes.items():
        if not 0 <= number < len(order):
            return Numbering(None, f"{where}: state for parameter {number}, which its param group does not list")
        want = tuple(model[order[number]].shape)
        for key, shape in states.items():
            if tuple(shape) and tuple(shape) != want:
                return Numbering(
                    None,
                    f"{where}: state {quote(str(key))} of parameter {number} has shape "
                    f"{list(shape)}, but model tensor {number} ({quote(order[number])}) has "
                    f"{list(want)}, so the model's order is not the optimizer's",
                )
    return Numbering({i: order[i] for i in numbers})


__all__ = [
    "META",
    "VERSION_KEY",
    "META_ATTR",
    "DEFAULT_STRIP_KEY",
    "add_meta",
    "annotate",
    "dcp_part",
    "is_lightning",
    "global_step",
    "model_prefix",
    "Numbering",
    "number_names",
]
