"""A Megatron-Core checkpoint as a training state in torch's terms, for convert and for
consolidate --include-optimizer: `model.<name>` per layer (and expert), `optim.state.<name>.<key>`
for each parameter's state, `optim.param_groups.<g>.<hyper>` with `params` naming the members.

What MCore keeps otherwise, and how it is read (names: optim_names.py):
- stacked layers (`decoder.layers.X` [L, ...]) and their optimizer state: one index view per
  layer into the stacked bytes (unstack.layer_view); nothing is read here.
- the step: one per optimizer (`optimizer.state.common_step`, or the distributed optimizer's
  group `step`), given to each parameter as torch's Adam keeps it.
- the param groups list no parameters: MCore's standard grouping (optim_names.member_groups)
  says which parameter is in which, or the optimizer is refused in one sentence.
- the distributed optimizer's `param` (its fp32 main copy): the model's own value when the model
  is stored at the same dtype (fp32 training: the same numbers), else the model's value in its
  place (the low-precision model copy left out, as convert does with ZeRO's fp32 masters).
- `dp_reshardable` flat buffers follow MCore's grad-buffer layout, which the checkpoint does not
  record per parameter: the optimizer is refused (the model alone can still be asked for).
- everything else (rng_state, args, iteration, `_extra_state`) is carried as it is.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from ...errors import UnsupportedError
from ...index.types import CheckpointIndex, ObjectEntry, TensorEntry
from ...torch_types import SmallTensor
from . import optim_names
from .legacy_join import LEGACY_KEY
from .names import FLAT_BUFFER
from .unstack import EXTRA_STATE, OUTPUT_LAYER, TRAINING_VIEW, layer_view

VIEW_KEY = TRAINING_VIEW  # index.metadata: "training" on a view made here (consolidate does not unstack it again)
FLAT_BUFFER_REFUSAL = (
    "its optimizer state is the distributed optimizer's dp_reshardable flat buffers ({n} tensors), laid "
    "out by MCore's grad buffers, which the checkpoint does not record per parameter, so it cannot be "
    "mapped to parameters; resave it with --dist-ckpt-optim-fully-reshardable, or {model_only}"
)


LEGACY_REFUSAL = (
    "its optimizer state (a legacy Megatron-LM checkpoint's, keyed by parameter number on each rank) is not "
    "joined by ckptkit; {model_only}, or have Megatron-LM save it as torch_dist and read that"
)
MODEL_ONLY_HINT = "convert the model alone (--model-only)"


def training_index(
    index: CheckpointIndex, optimizer: bool = True, model_only_hint: str = MODEL_ONLY_HINT, where: str = ""
) -> tuple[CheckpointIndex, list[str]]:
    """The training-state view of an MCore index, and notes on what it renamed or left out.
    `optimizer` False: the model and the other values only (the optimizer is counted in a note).
    `where`: the checkpoint as the user named it, for a refusal (default: the index's root)."""
    where = where or index.root
    view = CheckpointIndex(
        format=index.format,
        root=index.root,
        world_size=index.world_size,
        step=index.step,
        files=dict(index.files),
        checks=index.checks,
        metadata=dict(index.metadata, **{VIEW_KEY: "training"}),
    )
    tied = bool((index.metadata.get("megatron_args") or {}).get("tied"))
    model = _model(index, tied)
    notes = [_names_note(index, model, tied)]
    if optimizer and index.metadata.get(LEGACY_KEY):
        raise UnsupportedError(f"{where}: " + LEGACY_REFUSAL.format(model_only=model_only_hint))
    flat = [k for k in index.tensors if FLAT_BUFFER.fullmatch(k)]
    if optimizer and flat:
        raise UnsupportedError(f"{where}: " + FLAT_BUFFER_REFUSAL.format(n=len(flat), model_only=model_only_hint))
    left = dict(index.objects)
    if optimizer:
        optim = _Optimizer(index, model, where)
        optim.read()
        notes += optim.notes
        for e in optim.tensors:
            view.add_tensor(e)
        for o in optim.objects:
            view.add_object(o)
        for key in optim.used_objects:
            left.pop(key, None)
    else:
        notes += _optimizer_left_out(index, left)
    for name, entry in model.items():
        view.add_tensor(_renamed(entry, f"model.{name}", ("model", name)))
    for key, o in left.items():
        view.add_object(o)
    return view, [n for n in notes if n]


def _model(index: CheckpointIndex, tied: bool) -> dict[str, TensorEntry]:
    """Per-layer name -> entry (a view into the stacked tensor) of every model tensor."""
    model: dict[str, TensorEntry] = {}
    for key, entry in index.tensors.items():
        path = tuple(entry.path or (key,))
        if path[0] != "model" or key.endswith(EXTRA_STATE) or (tied and key == OUTPUT_LAYER):
            continue
        for name, at in optim_names.layer_names(key, tuple(entry.shape)):
            model[name] = layer_view(entry, at, name) if at else entry
    return model


def _renamed(entry: TensorEntry, key: str, path: tuple) -> TensorEntry:
    return dataclasses.replace(entry, key=key, path=path, attrs=dict(entry.attrs))


def _names_note(index: CheckpointIndex, model: dict[str, TensorEntry], tied: bool) -> str:
    stacked = sum(
        1
        for k in index.tensors
        if k.startswith(optim_names.STACKED) and (index.tensors[k].path or ())[:1] == ("model",)
    )
    text = (
        f"names: {stacked} stacked MCore tensors (decoder.layers.X [L, ...]) read as one tensor per layer and "
        f"expert, named as an MCore model's state_dict() names them (decoder.layers.<i>.X), {len(model)} in all"
    )
    if tied:
        text += f"; {OUTPUT_LAYER} is tied to the word embedding (args), so it is not a tensor of its own"
    return text


def _optimizer_left_out(index: CheckpointIndex, left: dict[str, ObjectEntry]) -> list[str]:
    """Without the optimizer: its entries left out of the view, counted in a note."""
    tensors = [k for k, e in index.tensors.items() if tuple(e.path or (k,))[0] == "optimizer"]
    values = [k for k, o in index.objects.items() if _is_optimizer_object(k, o)]
    for key in values:
        left.pop(key, None)
    if not tensors and not values:
        return []
    return [f"not read: the optimizer ({len(tensors)} tensors, {len(values)} values), as asked (the model alone)"]


def _is_optimizer_object(key: str, o: ObjectEntry) -> bool:
    path = tuple(o.path or (key,))
    return path[0] == "optimizer" or bool(FLAT_BUFFER.fullmatch(key.split("/")[0]))


class _Optimizer:
    """MCore's optimizer entries of one index as torch's: per-parameter state, steps and groups."""

    def __init__(self, index: CheckpointIndex, model: dict[str, TensorEntry], where: str) -> None:
        self.index, self.model, self.where = index, model, where
        self.tensors: list[TensorEntry] = []
        self.objects: list[ObjectEntry] = []
        self.used_objects: list[str] = []
        self.notes: list[str] = []
        self.chains: dict[int | None, list[str]] = {}  # chain -> its parameters (model order)
        self.steps: dict[int | None, Any] = {}  # chain -> its step (an entry, or a value)
        self.groups: dict[int | None, dict[int, dict[str, Any]]] = {}

    def read(self) -> None:
        main_same, main_used = self._states()
        self._group_values()
        self._place_groups()
        if main_same:
            self.notes.append(
                f"not carried: {main_same} distributed-optimizer main copies (optimizer.state.param.*): the "
                f"model holds the same values at the same dtype"
            )
        if main_used:
            self.notes.append(
                f"model: {main_used} tensors taken from the distributed optimizer's fp32 main copies "
                f"(optimizer.state.param.*); their low-precision model copies are not carried"
            )

    def _states(self) -> tuple[int, int]:
        """Each parameter's state tensors, per layer; (main copies left out, main copies used as the model)."""
        per_chain: dict[int | None, set[str]] = {}
        main_same = main_used = 0
        for key, entry in self.index.tensors.items():
            chain = optim_names.common_step_chain(key)
            if chain is not False:
                self.steps[chain] = entry
                continue
            parts = optim_names.split_state_key(key)
            if parts is None:
                continue
            for name, at in optim_names.layer_names(parts.param, tuple(entry.shape)):
                if name not in self.model:
                    raise UnsupportedError(
                        f"{self.where}: optimizer state {key} is for {name}, which the model does not hold"
                    )
                per_chain.setdefault(parts.chain, set()).add(name)
                view = layer_view(entry, at, name) if at else entry
                if parts.state == optim_names.MAIN_PARAM:
                    if view.dtype == self.model[name].dtype:
                        main_same += 1
                        continue
                    self.model[name] = view
                    main_used += 1
                    continue
                key_out = f"optim.state.{name}.{parts.state}"
                self.tensors.append(_renamed(view, key_out, ("optim", "state", name, parts.state)))
        order = list(self.model)
        self.chains = {c: sorted(names, key=order.index) for c, names in sorted(per_chain.items(), key=_chain_order)}
        return main_same, main_used

    def _group_values(self) -> None:
        """The saved param groups' values by chain and group (the distributed optimizer's nesting too)."""
        for key, o in self.index.objects.items():
            path = tuple(o.path or (key,))
            if path[0] != "optimizer":
                continue
            rest, chain = path[1:], None
            if rest and type(rest[0]) is int:
                chain, rest = rest[0], rest[1:]
            if rest and rest[0] == "optimizer":
                rest = rest[1:]
            if len(rest) == 3 and rest[0] == "param_groups" and type(rest[1]) is int:
                self.groups.setdefault(chain, {}).setdefault(rest[1], {})[rest[2]] = o.data
            elif len(rest) == 1 and rest[0] == "param_state_sharding_type":
                self.notes.append(f"not carried: {key} = {o.data!r} (MCore's own layout of its optimizer)")
            else:
                continue
            self.used_objects.append(key)

    def _place_groups(self) -> None:
        g_out = 0
        for chain, names in self.chains.items():
            saved = self.groups.get(chain, {})
            groups = [dict(saved[g]) for g in sorted(saved)]
            shapes = [(n, tuple(self.model[n].shape)) for n in names]
            members, why = optim_names.member_groups(groups, shapes)
            if why:
                where = f"optimizer {chain}" if chain is not None else "the optimizer"
                raise UnsupportedError(
                    f"{self.where}: {where}'s param groups cannot be given their parameters: {why} "
                    f"(MCore saves groups without their members); convert the model alone (--model-only)"
                )
            for group, params in zip(groups, members):
                step = group.pop("step", None)
                for hyper, value in group.items():
                    self._object(f"optim.param_groups.{g_out}.{hyper}", ("optim", "param_groups", g_out, hyper), value)
                self._object(f"optim.param_groups.{g_out}.params", ("optim", "param_groups", g_out, "params"), params)
                for name in params:
                    self._step(name, self.steps.get(chain, step))
                g_out += 1

    def _step(self, name: str, step: Any) -> None:
        key, path = f"optim.state.{name}.step", ("optim", "state", name, "step")
        if isinstance(step, TensorEntry):
            self.tensors.append(_renamed(step, key, path))
        elif step is not None:
            self._object(key, path, SmallTensor("float32", (), struct.pack("<f", float(step))))
        elif self.index.step is not None:  # no step kept by the optimizer: the iteration common.pt records
            self._object(key, path, SmallTensor("float32", (), struct.pack("<f", float(self.index.step))))

    def _object(self, key: str, path: tuple, value: Any) -> None:
        self.objects.append(ObjectEntry(key, value, path))


def _chain_order(item: tuple) -> int:
    return -1 if item[0] is None else item[0]
