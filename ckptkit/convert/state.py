"""One canonical training state read from any backend: what convert writes to every other one.

The state keeps references to the source's bytes (index entries), never the data: model tensors
by parameter name, each trainable parameter's optimizer state whatever the optimizer (tensors
shaped like the parameter are partitioned with it; steps and other per-parameter values are
kept whole, ckptkit/optim_state.py decides), the param groups (by name), which model tensors are
trainable, frozen, buffers or tied, and everything else as extras. DeepSpeed checkpoints say all
of this themselves; for torch checkpoints the roles come from the optimizer's param groups, from
sharding (FSDP shards parameters, not buffers) and from values (a tied weight is a
non-trainable tensor equal to a trainable one).

Nothing read is lost silently: every tensor and object of the source index is carried, rebuilt
by the target (`derived`, with why: DeepSpeed's low-precision copies and layout values), or
listed in `unmapped` (with what it is), which convert refuses to drop unless asked to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..context import RunContext
from ..errors import UnsupportedError, UsageError, name_of, quote
from ..formats.registry import Opened, capabilities_of
from ..index.types import CheckpointIndex, TensorEntry
from ..lazy_torch import is_tensor
from ..optim_state import PARTITIONED, kind_of, refuse_unmappable
from ..runner.fetch import Fetcher
from ..index.flatten import key_of
from .keys import (
    LOW_PRECISION_CONTAINERS,
    MODEL_CONTAINERS,
    OPTIM_CONTAINERS,
    Split,
    guess_step,
    optimizer_parts,
    split_roles,
)
from ..torch_types import SmallTensor
from .hf_ties import config_ties, source_config
from .hyper import DsOptimizer, ds_optimizer, source_is_ds_own, step_number
from .model_roles import classify_untracked
from .names import KeyRules

# DeepSpeed's values that mean something outside DeepSpeed's own optimizer objects
DS_CARRIED = (
    "global_steps",
    "global_samples",
    "skipped_steps",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "iteration",
    "ds_config",
    "ds_version",
)
FLAT_PARAM_MARKS = ("flat_param", "_flat_param")
LOW_PRECISION_WHY = "low-precision copies of the fp32 masters"
DS_LAYOUT_WHY = "DeepSpeed layout values of the saving run (world size, stage, loss scaler, clipping)"


@dataclass(kw_only=True)
class TrainingState:
    source: Opened
    model: dict[str, TensorEntry]  # name -> source entry
    frozen: list[str]
    buffers: list[str]
    ties: dict[str, str]  # alias -> owner
    param_states: dict[str, dict[str, TensorEntry]]  # name -> {state key: entry shaped like the parameter}
    whole_states: dict[str, dict[str, Any]]  # name -> {state key: int / float / 0-d tensor ...}
    groups: list[dict[str, Any]]  # hyperparameters, without "params"
    group_params: list[list[str]]
    extras: list[tuple[tuple, Any]] = field(default_factory=list)  # (path, value or TensorEntry)
    ds: dict[str, Any] = field(default_factory=dict)  # DeepSpeed's own values (global_steps, ...)
    ds_config: dict | None = None
    derived: dict[str, str] = field(default_factory=dict)  # source key -> why the target rebuilds it
    unmapped: dict[str, str] = field(default_factory=dict)  # source key -> what it is (would be lost)
    dropped: dict[str, str] = field(default_factory=dict)  # canonical key -> why (on request)
    optimizer_dropped: bool = False  # the whole optimizer left out on request
    numbered_why: str = ""  # the optimizer is keyed by parameter number: the refusal, unless dropped
    config_ties: dict[str, str] = field(default_factory=dict)  # the ties of `ties` only config.json records
    config_why: str = ""  # where they were read (said in the summary)
    notes: list[str] = field(default_factory=list)  # what the reading could not decide

    @property
    def from_deepspeed(self) -> bool:
        """Its tensors are DeepSpeed's flat partitions, read through DeepSpeed's own records."""
        return capabilities_of(self.source.index).flat_partitions

    @property
    def source_optimizer(self) -> DsOptimizer | None:
        """The DeepSpeed optimizer that wrote a DeepSpeed source (None for a torch source)."""
        return ds_optimizer(self.ds_config) if self.from_deepspeed else None

    @property
    def source_own(self) -> bool:
        """Written by DeepSpeed's own Adam-style optimizer (int steps, bias_correction in the groups)."""
        return source_is_ds_own(self.from_deepspeed, self.ds_config, self.groups)

    @property
    def steps(self) -> dict[str, Any]:
        """name -> the parameter's optimizer step, where its optimizer keeps one."""
        return {n: w["step"] for n, w in self.whole_states.items() if "step" in w}

    @property
    def state_keys(self) -> list[str]:
        """Every per-parameter state key, partitioned ones first, in first-seen order."""
        keys = dict.fromkeys(k for m in self.param_states.values() for k in m)
        keys.update(dict.fromkeys(k for m in self.whole_states.values() for k in m))
        return list(keys)

    @property
    def trainable(self) -> list[str]:
        """The trainable parameters, in param-group order."""
        return [n for ps in self.group_params for n in ps]

    @property
    def has_optimizer(self) -> bool:
        return bool(self.group_params)

    @property
    def global_step(self) -> int | None:
        steps = self.ds.get("global_steps")
        if isinstance(steps, int):
            return steps
        guessed = guess_step(self.source.index)
        if guessed is not None:
            return guessed
        values = {int(float(step_number(v))) for v in self.steps.values()}
        return max(values) if values else None

    def group_whole(self, g: int, key: str) -> Any:
        """The value of whole state `key` all params of group g share (ZeRO keeps one per group);
        None when no parameter of the group has it."""
        values = {
            _value_id(self.whole_states[n][key]) for n in self.group_params[g] if key in self.whole_states.get(n, {})
        }
        if len(values) > 1:
            raise UnsupportedError(
                f"param group {g} has parameters with different optimizer {quote(key)} values "
                f"({sorted(values)[:4]}); ZeRO keeps one per group"
            )
        for n in self.group_params[g]:
            if key in self.whole_states.get(n, {}):
                return self.whole_states[n][key]
        return None

    def group_step(self, g: int) -> Any:
        """The step all params of group g share (ZeRO keeps one per group), 0 when none has one."""
        value = self.group_whole(g, "step")
        return 0 if value is None else value


def _value_id(value: Any) -> str:
    """A comparable identity of a whole state value (a number, a SmallTensor, a torch tensor)."""
    if isinstance(value, SmallTensor) or is_tensor(value):
        try:
            return repr(step_number(value))
        except (UnsupportedError, RuntimeError, ValueError):
            return repr(value.tolist())
    return repr(value)


def read_state(
    opened: Opened, rules: KeyRules | None = None, frozen_patterns: tuple[str, ...] = (), ctx: RunContext | None = None
) -> TrainingState:
    """`ctx`: the run's context (the bit-identity check of tied weights reads within its budget)."""
    rules = rules or KeyRules()
    if capabilities_of(opened.index).flat_partitions:
        state = _from_deepspeed(opened, rules)
    else:
        state = _from_torch_layout(opened, rules, frozen_patterns, ctx or RunContext())
    _check_partners(state)
    return state


class _OptimState:
    """Per-parameter optimizer state as read, each value placed by its shape (optim_state.kind_of)."""

    def __init__(self, where: str, fetcher: Fetcher, shapes: dict[str, tuple[int, ...]]) -> None:
        self.where, self.fetcher, self.shapes = where, fetcher, shapes
        self.partitioned: dict[str, dict[str, TensorEntry]] = {}
        self.whole: dict[str, dict[str, Any]] = {}

    def add(self, name: str, key: str, value: Any, source_key: str) -> None:
        refuse_unmappable(key, f"{self.where} ({source_key})")
        if isinstance(value, TensorEntry):
            shape = self.shapes.get(name)
            if shape is not None and kind_of(key, value.shape, shape) == PARTITIONED:
                self.partitioned.setdefault(name, {})[key] = value
                return
            value = self.fetcher.read_small(value)  # a step, a per-parameter scalar: small, kept whole
        self.whole.setdefault(name, {})[key] = value


def _from_deepspeed(opened: Opened, rules: KeyRules) -> TrainingState:
    index = opened.index
    rules = rules.for_names([k[len("model.") :] for k in index.tensors if k.startswith("model.")])
    model, frozen, buffers, ties = _deepspeed_model(index, rules)
    optim = _OptimState(
        str(opened.path), Fetcher(opened.source, index=index), {n: tuple(e.shape) for n, e in model.items()}
    )
    entries = _DeepSpeedEntries(rules, optim)
    entries.add_tensors(index.tensors)
    entries.add_objects(index.objects)
    group_list, group_params = _named_groups(entries.groups, rules)
    cfg = entries.ds.get("ds_config")
    return TrainingState(
        source=opened,
        model=model,
        frozen=frozen,
        buffers=buffers,
        ties=ties,
        param_states=optim.partitioned,
        whole_states=optim.whole,
        groups=group_list,
        group_params=group_params,
        extras=entries.extras,
        ds=entries.ds,
        ds_config=cfg if isinstance(cfg, dict) else None,
        derived=entries.derived,
        unmapped=entries.unmapped,
    )


def _deepspeed_model(
    index: CheckpointIndex, rules: KeyRules
) -> tuple[dict[str, TensorEntry], list[str], list[str], dict[str, str]]:
    """(model, frozen, buffers, ties) by name, as the DeepSpeed reader's roles say."""
    model, frozen, buffers, ties = {}, [], [], {}
    for key, e in index.tensors.items():
        if not key.startswith("model."):
            continue
        name = rules.apply(key[len("model.") :])
        model[name] = e
        role = e.attrs.get("ds_role")
        if "alias_of" in e.attrs:
            ties[name] = rules.apply(e.attrs["alias_of"][len("model.") :])
        elif role == "frozen":
            frozen.append(name)
        elif role == "buffer":
            buffers.append(name)
    return model, frozen, buffers, ties


class _DeepSpeedEntries:
    """A DeepSpeed checkpoint's entries besides the model, each sorted once by its path: optimizer
    state, a param group's entry, client state (extras), DeepSpeed's values, or unmapped."""

    def __init__(self, rules: KeyRules, optim: _OptimState) -> None:
        self.rules, self.optim = rules, optim
        self.extras: list[tuple[tuple, Any]] = []
        self.groups: dict[int, dict[str, Any]] = {}
        self.ds: dict[str, Any] = {}
        self.derived: dict[str, str] = {}
        self.unmapped: dict[str, str] = {}

    def add_tensors(self, tensors: dict[str, TensorEntry]) -> None:
        for key, e in tensors.items():
            p = tuple(e.path or (key,))
            if key.startswith("model."):
                continue
            if len(p) == 4 and p[:2] == ("optim", "state"):
                self.optim.add(self.rules.apply(p[2]), str(p[3]), e, key)
            elif p[0] == "client" and len(p) > 1:
                self.extras.append((p[1:], e))
            elif p[0] in LOW_PRECISION_CONTAINERS:
                self.derived[key] = LOW_PRECISION_WHY
            else:
                self.unmapped[key] = "a DeepSpeed tensor outside the model, its optimizer state and the client state"

    def add_objects(self, objects: dict[str, Any]) -> None:
        for key, o in objects.items():
            p = tuple(o.path or (key,))
            # values as read (stand-ins for torch's types): the writers re-emit them as torch's
            if len(p) == 4 and p[:2] == ("optim", "state"):
                self.optim.add(self.rules.apply(p[2]), str(p[3]), o.data, key)
            elif len(p) == 4 and p[:2] == ("optim", "param_groups"):
                self.groups.setdefault(int(p[2]), {})[p[3]] = o.data
            elif p[0] == "client" and len(p) > 1:
                self.extras.append((p[1:], o.data))
            elif p[0] == "ds" and len(p) == 2 and p[1] in DS_CARRIED:
                self.ds[p[1]] = o.data
            elif p[0] == "ds":
                self.derived[key] = DS_LAYOUT_WHY
            else:
                self.unmapped[key] = "a DeepSpeed value outside the model, its optimizer and the client state"


def _named_groups(groups: dict[int, dict[str, Any]], rules: KeyRules) -> tuple[list[dict], list[list[str]]]:
    """(hyperparameters of each group without "params", the group's parameter names), in order."""
    group_list = [groups[g] for g in sorted(groups)]
    return group_list, [[rules.apply(n) for n in g.pop("params", [])] for g in group_list]


def _optim_names(split: Split) -> tuple[dict[str, str], dict[str, Any]]:
    """(index key -> parameter name of a state entry, index key -> a param group's `params` with
    names): keys.py gives numbered state (Lightning's .ckpt) names where its rule proves them."""
    names, values = {}, {}
    for name, (_prefix, param, _statekey) in split.optim_params.items():
        key = split.optim.get(name) or split.optim_objects.get(name)
        if key is not None:
            names[key] = param
    for name, value in split.optim_values.items():
        if name in split.optim_objects:
            values[split.optim_objects[name]] = value
    return names, values


def _from_torch_layout(
    opened: Opened, rules: KeyRules, frozen_patterns: tuple[str, ...], ctx: RunContext
) -> TrainingState:
    index = opened.index
    split = split_roles(index)
    _refuse_flat_parameters(opened, list(split.model))
    raw = {n: index.tensors[k] for n, k in split.model.items()}
    config = config_ties(source_config(opened.path, index.format, ctx.follow_links), raw)
    raw.update({alias: raw[owner] for alias, owner in config.ties.items()})  # save_pretrained left them out
    rules = rules.for_names(list(raw))
    model = {rules.apply(n): e for n, e in raw.items()}
    if len(model) != len(raw):
        raise UsageError(f"{opened.path}: the name rules map two model tensors to the same name")
    fetcher = Fetcher(opened.source, index=index)
    optim = _OptimState(str(opened.path), fetcher, {n: tuple(e.shape) for n, e in model.items()})
    entries = _TorchEntries(str(opened.path), split, rules, optim)
    entries.add_tensors(index.tensors)
    entries.add_objects(index.objects)
    numbered_why = entries.refuse_numbered()
    group_list, group_params = _named_groups(entries.groups, rules)
    trainable = {n for ps in group_params for n in ps} & set(model)
    config_tied = {rules.apply(a): rules.apply(o) for a, o in config.ties.items()}
    frozen, buffers, ties = classify_untracked(
        opened,
        {n: e for n, e in model.items() if n not in config_tied},
        trainable,
        frozen_patterns,
        fetcher,
        ctx.slab_bytes_for(2),
        weights_only=not group_params,
    )
    ties.update(config_tied)
    return TrainingState(
        source=opened,
        model=model,
        frozen=frozen,
        buffers=buffers,
        ties=ties,
        config_ties=config_tied,
        config_why=config.why,
        notes=config.notes,
        param_states=optim.partitioned,
        whole_states=optim.whole,
        groups=group_list,
        group_params=group_params,
        extras=entries.extras,
        ds=entries.ds,
        derived=entries.derived,
        unmapped=entries.unmapped,
        numbered_why=numbered_why,
    )


def _refuse_flat_parameters(opened: Opened, raw_names: list[str]) -> None:
    """FSDP1's LOCAL_STATE_DICT flat parameters cannot be unflattened from the file alone."""
    for n in raw_names:
        if any(n.endswith(m) or f"{m}." in n for m in FLAT_PARAM_MARKS):
            raise UnsupportedError(
                f"{opened.path}: tensor {name_of(n)} is an FSDP1 flat parameter (LOCAL_STATE_DICT): its layout "
                f"depends on how the model was wrapped, so it cannot be unflattened from the file alone; "
                f"save with StateDictType.SHARDED_STATE_DICT (or FULL_STATE_DICT) and convert that"
            )


class _TorchEntries:
    """A torch checkpoint's entries besides the model, each sorted once: a parameter's optimizer
    state, a param group's entry, a low-precision copy, an extra, DeepSpeed's counters, or unmapped."""

    def __init__(self, where: str, split: Split, rules: KeyRules, optim: _OptimState) -> None:
        self.where, self.split, self.rules, self.optim = where, split, rules, optim
        self.model_keys = set(split.model.values())
        self.state_names, self.group_values = _optim_names(split)
        self.slots: dict[str, None] = {}
        self.groups: dict[int, dict[str, Any]] = {}
        self.extras: list[tuple[tuple, Any]] = []
        self.derived: dict[str, str] = {}
        self.unmapped: dict[str, str] = {}
        self.ds: dict[str, Any] = {}
        self.numbered: dict[str, str] = {}  # index key -> why its optimizer is keyed by parameter number
        self.group_keys: dict[str, None] = {}  # index keys of param-group entries

    def add_tensors(self, tensors: dict[str, TensorEntry]) -> None:
        for key, e in tensors.items():
            if key in self.model_keys:
                continue
            path = tuple(e.path) if e.path else (key,)
            parts = self._parts_of(path, key)
            if parts is not None and self._optim_entry(parts, e, key):
                continue
            if path[0] in LOW_PRECISION_CONTAINERS:
                self.derived[key] = LOW_PRECISION_WHY
                continue
            self.extras.append((path, e))

    def add_objects(self, objects: dict[str, Any]) -> None:
        for key, o in objects.items():
            path = tuple(o.path) if o.path else (key,)
            parts = self._parts_of(path, key)
            if parts is not None and self._optim_entry(parts, o.data, key):
                continue
            if path[0] in OPTIM_CONTAINERS or path[0] in MODEL_CONTAINERS:
                if _empty(o.data):  # an optimizer's empty state, an empty container: nothing to lose
                    self.derived[key] = "empty"
                else:
                    self.unmapped[key] = (
                        f"a value inside the "
                        f"{'optimizer' if path[0] in OPTIM_CONTAINERS else 'model'} "
                        f"state that is neither a parameter's state nor a param group"
                    )
                continue
            if len(path) >= 2 and path[0] == "ds" and path[1] in DS_CARRIED:
                _nest(self.ds, path[1:], o.data)  # DeepSpeed's counters a conversion from ZeRO wrote as ds.*
            else:
                self.extras.append((path, o.data))

    def refuse_numbered(self) -> str:
        """Optimizer state keyed by parameter number cannot be placed, only dropped (--model-only) or
        refused: its entries become unmapped, and the refusal is returned ('' when names are known)."""
        if not self.numbered:
            return ""
        why = next((w for w in self.numbered.values() if w), "")
        numbered_why = (
            f"{self.where}: optimizer state is keyed by parameter number ({next(iter(self.numbered))})"
            + (f": {why}" if why else "")
            + "; ckptkit needs parameter names: save it with "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict (or "
            "FSDP.optim_state_dict), which key it by name, or convert the model alone (--model-only)"
        )
        partitioned = [e.key for m in self.optim.partitioned.values() for e in m.values()]
        for key in list(self.numbered) + list(self.group_keys) + partitioned:
            self.unmapped[key] = "optimizer state keyed by parameter number"
        self.groups.clear()
        self.optim.partitioned.clear()
        self.optim.whole.clear()
        return numbered_why

    def _parts_of(self, path: tuple, key: str) -> tuple | None:
        """The path below its optimizer container (Lightning's numbered state given its names)."""
        found = optimizer_parts(path) if key not in self.model_keys else None
        if found is None:
            return None
        slot, rest = found
        self.slots[slot] = None
        if len(self.slots) > 1:  # their groups and states would merge under one `optim`
            raise UnsupportedError(
                f"{self.where}: holds {len(self.slots)} optimizers ({', '.join(self.slots)}); "
                f"convert carries one optimizer's state (a run with several cannot be mapped "
                f"onto one)"
            )
        if len(rest) >= 3 and rest[0] == "state":
            return ("state", self.state_names.get(key, rest[1]), key_of(rest[2:]), slot)
        return tuple(rest) + (slot,)

    def _optim_entry(self, parts: tuple, value: Any, where: str) -> bool:
        """Place an optimizer entry (True), or say it is none (False)."""
        slot, parts = parts[-1], parts[:-1]
        if len(parts) >= 2 and parts[0] == "state":
            if isinstance(parts[1], int) or str(parts[1]).isdigit():
                self.numbered[where] = self.split.numbered.get(slot, "")
                return True
            if len(parts) != 3:
                return False
            self.optim.add(self.rules.apply(str(parts[1])), str(parts[2]), value, where)
            return True
        if len(parts) == 3 and parts[0] == "param_groups" and isinstance(parts[1], int):
            value = self.group_values.get(where, value)
            self.group_keys[where] = None
            if (
                parts[2] == "params"
                and isinstance(value, list)
                and value
                and not all(isinstance(v, str) for v in value)
            ):
                self.numbered[where] = self.split.numbered.get(slot, "")
                return True
            self.groups.setdefault(parts[1], {})[parts[2]] = value
            return True
        return False


def _nest(root: dict, path: tuple, value: Any) -> None:
    node = root
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (dict, list, tuple)) and not value)


def _check_partners(state: TrainingState) -> None:
    lonely = sorted(n for n in set(state.param_states) | set(state.whole_states) if n not in state.model)
    lonely += sorted(
        f"{n} (param group {g})" for g, ps in enumerate(state.group_params) for n in ps if n not in state.model
    )
    if lonely:
        shown = ", ".join(lonely[:8]) + (f" and {len(lonely) - 8} more" if len(lonely) > 8 else "")
        sample = ", ".join(list(state.model)[:3])
        raise UsageError(
            f"{state.source.path}: optimizer entries name parameters the model does not have: {shown} "
            f"(model names look like: {sample}); fix the names with --strip-prefix, --add-prefix "
            f"or --rename OLD=NEW"
        )
    counts = Counter(n for ps in state.group_params for n in ps)
    dup = {n for n, c in counts.items() if c > 1}
    if dup:
        raise UsageError(f"{state.source.path}: parameters in more than one param group: {sorted(dup)[:5]}")


def flat_extras(extras: list[tuple[tuple, Any]]) -> list[tuple[tuple, Any]]:
    """Extras as leaves, flattened the way DCP flattens a state dict (dicts recurse)."""
    from ..index.flatten import flatten

    out = []
    for path, value in extras:
        if isinstance(value, dict) and value:
            for sub, leaf in flatten(value, lambda v: isinstance(v, SmallTensor) or is_tensor(v)):
                out.append((tuple(path) + tuple(sub), leaf))
        else:
            out.append((tuple(path), value))
    return out


def config_tie_text(state: TrainingState) -> str:
    """' (a -> b taken from config.json's ...)': the ties only the config records, said (or '')."""
    if not state.config_ties:
        return ""
    pairs = ", ".join(f"{a} -> {o}" for a, o in list(state.config_ties.items())[:3])
    more = f" and {len(state.config_ties) - 3} more" if len(state.config_ties) > 3 else ""
    return f" ({pairs}{more} taken from {state.config_why})"


def describe(state: TrainingState) -> str:
    """One line: the model's roles, then the optimizer state by key name (never a silent 0)."""
    partitioned = dict.fromkeys(k for m in state.param_states.values() for k in m)
    whole = dict.fromkeys(k for m in state.whole_states.values() for k in m)
    n_part = sum(len(m) for m in state.param_states.values())
    n_whole = sum(len(m) for m in state.whole_states.values())
    trainable = [n for n in state.trainable if n in state.model]
    text = (
        f"{len(trainable)} trainable, {len(state.frozen)} frozen, {len(state.buffers)} buffers, "
        f"{len(state.ties)} tied{config_tie_text(state)}; "
    )
    if state.optimizer_dropped:
        return text + "no optimizer (dropped on request)"
    text += f"{len(state.group_params)} param groups; {n_part} optimizer state tensors" + (
        f" ({', '.join(partitioned)})" if partitioned else ""
    )
    if n_whole:
        text += f", {n_whole} per-parameter values ({', '.join(whole)})"
    return text


__all__ = ["TrainingState", "read_state", "flat_extras", "describe", "config_tie_text"]
