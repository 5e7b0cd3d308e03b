"""The canonical state as a native DeepSpeed ZeRO checkpoint, built from the user's DeepSpeed config.

What DeepSpeed's layout depends on comes from the config: the stage, the precision (fp16 / bf16 /
fp32 module weights, the `bf16_` file prefix), sub_group_size, parameter_alignment, the optimizer
(DeepSpeed's Adam keeps an int step and `bias_correction`; a torch optimizer, i.e. torch_adam, a
torch.optim type or no "optimizer" section, keeps torch's state and groups as they are). Every
optimizer state shaped like its parameter becomes a flat partition; whole values (a step) are
each group's one value. Group
membership and order come from the source optimizer's param groups. The files DeepSpeed's
`load_checkpoint` reads are then assembled as templates and written by the same streaming writer
that reshards ZeRO checkpoints: fp32 partitions and optimizer states are virtual slices of the source
tensors, the low-precision module weights the cast of the masters.

Values DeepSpeed keeps that a torch checkpoint does not have start fresh, as documented:
global_steps = the training step (the source's `step`-like value, else the optimizer step),
global_samples = global_steps * train_batch_size, skipped_steps = 0, the loss scaler from the
config, the lr scheduler at last_batch_iteration = global_steps - 1 when one is configured.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedError, UsageError
from ..formats.protocols import FlatGroup, ZeroStateTarget
from ..index.dtypes import itemsize
from ..index.lazy import LazyTensor
from ..index.state_keys import model_key, model_path, state_key, state_path
from ..index.types import CheckpointIndex, ObjectEntry, TensorEntry
from ..index.virtual import inline_tensor
from ..repickle import stand_in, stand_in_call
from ..torch_types import DType, Size, SmallTensor
from .hyper import DsOptimizer, check_target_holds, deepspeed_groups, deepspeed_step, ds_optimizer, torch_groups
from .state import TrainingState
from .to_torch_layouts import view

DS_FORMAT_VERSION = "0.19.8"  # the DeepSpeed release whose file layout this writes
LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
DYNAMIC_LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"


def config_precision(cfg: dict) -> str:
    if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled"):
        return "bfloat16"
    if (cfg.get("fp16") or {}).get("enabled"):
        return "float16"
    return "float32"


def _loss_scaler(cfg: dict, precision: str, global_step: int) -> tuple[Any, bool]:
    fp16 = cfg.get("fp16") or {}
    if precision != "float16":
        return stand_in(LOSS_SCALER, cur_scale=1.0, dynamic=False), False
    static = float(fp16.get("loss_scale", 0) or 0)
    if static > 0:
        return stand_in(LOSS_SCALER, cur_scale=static, dynamic=False), False
    hysteresis = int(fp16.get("hysteresis", 2))
    return stand_in(
        DYNAMIC_LOSS_SCALER,
        cur_scale=2 ** int(fp16.get("initial_scale_power", 16)),
        dynamic=True,
        cur_iter=global_step,
        last_overflow_iter=-1,
        scale_factor=2.0,
        scale_window=int(fp16.get("loss_scale_window", 1000)),
        min_scale=fp16.get("min_loss_scale", 1),
        delayed_shift=hysteresis,
        cur_hysteresis=hysteresis,
        consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)),
        raise_error_at_min_scale=True,
        dtype=DType("float16"),
    ), True


def _alignment_paddings(names: list[tuple[str, int]], cfg_zero: dict, precision: str) -> list[int]:
    """DeepSpeed's per-parameter padding inside a stage-1/2 group (parameter_alignment)."""
    if not cfg_zero.get("parameter_alignment"):
        return [0] * len(names)
    item = itemsize(precision)
    align = 16 // math.gcd(16, item)
    out, offset = [], 0
    for i, (_, numel) in enumerate(names):
        offset += numel
        pad = 0 if i == len(names) - 1 else (-offset) % align
        out.append(pad)
        offset += pad
    return out


@dataclass(frozen=True, kw_only=True)
class _Target:
    """The ZeRO checkpoint asked for: --to zeroN, --world-size and the DeepSpeed config."""

    stage: int
    world_size: int
    cfg: dict
    zero_cfg: dict
    precision: str  # the module weights' dtype
    step: int
    optimizer: DsOptimizer  # the optimizer the config makes


def zero_target_from_state(state: TrainingState, stage: int, world_size: int, cfg: dict) -> ZeroStateTarget:
    """The ZeRO checkpoint of `state` at `stage` for `world_size` ranks, laid out by the DeepSpeed
    config `cfg`: templates the DeepSpeed format (its format.py) names and turns into files."""
    target = _target(state, stage, world_size, cfg)
    group_keys = _group_state_keys(state, target.optimizer)
    index, resolver = _state_tensors(state, group_keys, target.precision)
    hypers = deepspeed_groups(_target_groups(state, target.optimizer), target.optimizer)
    group_whole = _whole_values(state, target.optimizer, group_keys, index)
    module = _module(state, target, index, resolver)
    index.tensors.update(resolver)
    groups = _zero_groups(state, target)
    return ZeroStateTarget(
        index=index,
        source=state.source.source,
        source_index=state.source.index,
        stage=stage,
        world_size=world_size,
        step=target.step,
        precision=target.precision,
        groups=tuple(groups),
        model_template=_model_template(state, target, module, groups, index),
        optim_template=_optim_template(target, hypers, group_whole, group_keys, groups),
        frozen={n: tuple(state.model[n].shape) for n in state.frozen},
        buffers=tuple(state.buffers),
        shared=dict(state.ties),
        zero_config=target.zero_cfg,
    )


def _target(state: TrainingState, stage: int, world_size: int, cfg: dict) -> _Target:
    """What to write, refusing what a ZeRO checkpoint of this config cannot hold."""
    if not state.has_optimizer or state.optimizer_dropped:
        raise UsageError(
            f"{state.source.path}: has no optimizer state (param groups); a ZeRO checkpoint is an "
            f"optimizer checkpoint, so converting to ZeRO needs one"
        )
    zero_cfg = cfg.get("zero_optimization") or {}
    cfg_stage = zero_cfg.get("stage")
    if cfg_stage is not None and int(cfg_stage) != stage:
        raise UsageError(f"--to zero{stage} but the DeepSpeed config says zero_optimization.stage {cfg_stage}")
    if zero_cfg.get("round_robin_gradients") and stage < 3:
        raise UnsupportedError("round_robin_gradients reorders ZeRO partitions; converting to it is not supported")
    optimizer = ds_optimizer(cfg)
    check_target_holds(optimizer, state.state_keys)
    return _Target(
        stage=stage,
        world_size=world_size,
        cfg=cfg,
        zero_cfg=zero_cfg,
        precision=config_precision(cfg),
        step=state.global_step or 0,
        optimizer=optimizer,
    )


def _state_tensors(
    state: TrainingState, group_keys: list[tuple[list[str], list[str]]], precision: str
) -> tuple[CheckpointIndex, dict[str, TensorEntry]]:
    """The index the writer reads: fp32 masters and partitioned states of each group, then the
    frozen params in the module's precision (views over the source's tensors, resolved by `resolver`)."""
    index = CheckpointIndex(format="deepspeed", root="")
    resolver: dict[str, TensorEntry] = {}
    for g, names in enumerate(state.group_params):
        for name in names:
            index.add_tensor(view(model_key(name), state.model[name], resolver, model_path(name), "float32"))
            for what in group_keys[g][0]:
                index.add_tensor(
                    view(
                        state_key(name, what),
                        state.param_states[name][what],
                        resolver,
                        state_path(name, what),
                        "float32",
                    )
                )
    for name in state.frozen:
        index.add_tensor(view(model_key(name), state.model[name], resolver, model_path(name), precision))
    return index, resolver


def _whole_values(
    state: TrainingState, optimizer: DsOptimizer, group_keys: list[tuple[list[str], list[str]]], index: CheckpointIndex
) -> list[OrderedDict[str, Any]]:
    """Whole values: ZeRO keeps one per group (a step: an int for DeepSpeed's own optimizer, torch's
    0-d tensor for a torch optimizer), also given per parameter for the writer to check."""
    group_whole: list[OrderedDict[str, Any]] = []
    for g, names in enumerate(state.group_params):
        values: OrderedDict[str, Any] = OrderedDict()
        if optimizer.own:
            values["step"] = deepspeed_step(state.group_step(g), optimizer)
        for what in group_keys[g][1]:
            value = state.group_whole(g, what)
            values[what] = deepspeed_step(value, optimizer) if what == "step" else value
        group_whole.append(values)
        for n in names:
            for what, value in values.items():
                index.add_object(ObjectEntry(state_key(n, what), value, path=state_path(n, what)))
    return group_whole


def _module(
    state: TrainingState, target: _Target, index: CheckpointIndex, resolver: dict[str, TensorEntry]
) -> OrderedDict[str, Any]:
    """The module state dict DeepSpeed loads strictly: params cast to the module dtype (ZeRO-3:
    empty placeholders), buffers as they are."""
    module: OrderedDict[str, Any] = OrderedDict()
    for name, entry in state.model.items():
        if name in state.buffers:
            module[name] = _lazy(view(f"module.{name}", entry, resolver), index)
        elif target.stage == 3:
            module[name] = _lazy(inline_tensor(f"module.{name}", SmallTensor(target.precision, (0,), b"")), index)
        else:
            owner = state.ties.get(name, name)
            src = index.tensors.get(model_key(owner)) or state.model[owner]
            module[name] = _lazy(view(f"module.{name}", src, resolver, dtype=target.precision), index)
    return module


def _zero_groups(state: TrainingState, target: _Target) -> list[FlatGroup]:
    """One ZeRO group per param group, with stage 1/2's alignment paddings."""
    groups = []
    for g, names in enumerate(state.group_params):
        shaped = tuple((n, tuple(state.model[n].shape)) for n in names)
        pads = None
        if target.stage < 3:
            pads = _alignment_paddings([(n, math.prod(s)) for n, s in shaped], target.zero_cfg, target.precision)
        groups.append(FlatGroup(params=shaped, paddings=tuple(pads) if pads and any(pads) else None))
    return groups


def _model_template(
    state: TrainingState,
    target: _Target,
    module: OrderedDict[str, Any],
    groups: list[FlatGroup],
    index: CheckpointIndex,
) -> OrderedDict[str, Any]:
    """The model-states file as DeepSpeed saves it, in its key order; extras (client state) last."""
    stage = target.stage
    frozen_shapes = OrderedDict((n, Size(state.model[n].shape)) for n in state.frozen)
    model_t: OrderedDict[str, Any] = OrderedDict()
    model_t["module"] = module
    model_t["buffer_names"] = list(state.buffers)
    model_t["optimizer"] = None
    model_t["param_shapes"] = [OrderedDict((n, Size(s)) for n, s in g.params) for g in groups] if stage < 3 else []
    model_t["frozen_param_shapes"] = frozen_shapes if (stage > 1 and frozen_shapes) else None
    model_t["shared_params"] = dict(state.ties)
    model_t["frozen_param_fragments"] = None
    if stage == 2 and state.frozen:
        model_t["frozen_param_fragments"] = OrderedDict(
            (n, _lazy(index.tensors[model_key(n)], index)) for n in state.frozen
        )
    model_t.update(_deepspeed_values(state, target))
    reserved = set(model_t)
    for path, value in state.extras:
        if len(path) == 1 and path[0] in reserved:
            raise UsageError(f"{state.source.path}: extra value {path[0]!r} would overwrite DeepSpeed's own entry")
        if isinstance(value, TensorEntry):
            value = _lazy(value, index)
        _nest(model_t, path, value)
    return model_t


def _deepspeed_values(state: TrainingState, target: _Target) -> OrderedDict[str, Any]:
    """DeepSpeed's own values: carried from a DeepSpeed source, else started fresh (module docstring)."""
    cfg, step = target.cfg, target.step
    train_batch = cfg.get("train_batch_size")
    if not isinstance(train_batch, int):
        micro = cfg.get("train_micro_batch_size_per_gpu", 1)
        train_batch = int(micro) * int(cfg.get("gradient_accumulation_steps", 1)) * target.world_size
    values: OrderedDict[str, Any] = OrderedDict()
    values["lr_scheduler"] = state.ds.get(
        "lr_scheduler", {"last_batch_iteration": step - 1} if cfg.get("scheduler") else None
    )
    values["data_sampler"] = state.ds.get("data_sampler")
    values["random_ltd"] = state.ds.get("random_ltd")
    values["skipped_steps"] = state.ds.get("skipped_steps", 0)
    values["global_steps"] = step
    values["global_samples"] = state.ds.get("global_samples", step * train_batch)
    values["dp_world_size"] = target.world_size
    values["mp_world_size"] = 1
    values["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 1}
    values["ds_config"] = dict(cfg)
    values["ds_version"] = DS_FORMAT_VERSION
    return values


def _optim_template(
    target: _Target,
    hypers: list[dict],
    group_whole: list[OrderedDict[str, Any]],
    group_keys: list[tuple[list[str], list[str]]],
    groups: list[FlatGroup],
) -> OrderedDict[str, Any]:
    """The optim-states file as the stage saves it. The optimizer's state per group as its
    state_dict orders it: whole values (step) first, then the partitioned states (None here: the
    writer puts each rank's flat slice in their place)."""
    group_states = OrderedDict(
        (g, OrderedDict(list(group_whole[g].items()) + [(k, None) for k in group_keys[g][0]]))
        for g in range(len(hypers))
    )
    base_state = {"state": group_states, "param_groups": [dict(h, params=[g]) for g, h in enumerate(hypers)]}
    scaler, dynamic = _loss_scaler(target.cfg, target.precision, target.step)
    zero_stage = stand_in_call(ZERO_STAGE_ENUM, target.stage)
    osd: OrderedDict[str, Any] = OrderedDict()
    if target.stage < 3:
        osd["loss_scaler"] = scaler
        osd["dynamic_loss_scale"] = dynamic
        osd["overflow"] = False
        osd["clip_grad"] = float(target.cfg.get("gradient_clipping", 1.0))
        osd["base_optimizer_state"] = base_state
        osd["single_partition_of_fp32_groups"] = []
        osd["zero_stage"] = zero_stage
        osd["group_paddings"] = []
        osd["param_alignment_paddings"] = [list(g.paddings) if g.paddings else [0] * len(g.params) for g in groups]
        osd["partition_count"] = [target.world_size] * len(hypers)
        osd["ds_version"] = DS_FORMAT_VERSION
        osd["param_slice_mappings"] = []
    else:
        osd["zero_stage"] = zero_stage
        osd["loss_scaler"] = scaler
        osd["dynamic_loss_scale"] = dynamic
        osd["overflow"] = False
        osd["partition_count"] = target.world_size
        osd["optimizer_state_dict"] = base_state
        osd["fp32_flat_groups"] = []
    return OrderedDict(optimizer_state_dict=osd, ds_config=dict(target.cfg), ds_version=DS_FORMAT_VERSION)


def _group_state_keys(state: TrainingState, target: Any) -> list[tuple[list[str], list[str]]]:
    """(partitioned keys, whole keys) of each param group. A ZeRO partition holds a key over the
    whole flat group, so every parameter of a group must have it; DeepSpeed's own optimizer
    needs exactly its own keys."""
    outside = sorted((set(state.param_states) | set(state.whole_states)) - set(state.trainable))
    if outside:  # ZeRO keeps state only inside its flat groups: it would be lost
        raise UsageError(
            f"{state.source.path}: optimizer state of parameters in no param group ({outside[:5]}); "
            f"a ZeRO checkpoint holds state only for its groups' parameters"
        )
    out = []
    for g, names in enumerate(state.group_params):
        if not names:  # an empty group: nothing to partition
            out.append(([], []))
            continue
        part = list(dict.fromkeys(k for n in names for k in state.param_states.get(n, {})))
        whole = list(dict.fromkeys(k for n in names for k in state.whole_states.get(n, {})))
        lacking = [n for n in names if set(part) - set(state.param_states.get(n, {}))]
        need = sorted(target.holds() or ()) if target.own else []
        if lacking or (need and set(need) - set(part)) or (not part and not whole and names):
            shown = lacking[:5] or names[:5]
            keys = ", ".join(need or part) or "any"
            raise UsageError(
                f"{state.source.path}: trainable parameters of param group {g} without optimizer "
                f"state {keys} (never stepped?): {shown}; a ZeRO checkpoint needs it for every "
                f"parameter of a group"
            )
        if target.own:
            whole = [k for k in whole if k != "step"]
        out.append((part, whole))
    return out


def _target_groups(state: TrainingState, target: Any) -> list[dict]:
    """The source's groups for the target optimizer: DeepSpeed's own Adam groups become torch's for
    a torch optimizer; torch's pass to DeepSpeed's own untouched (deepspeed_groups adds its keys)."""
    if state.source_own and not target.own:
        src = state.source_optimizer
        return torch_groups(state.groups, True, src.adam_w_mode if src is not None else True)
    return state.groups


def _lazy(entry: TensorEntry, index: CheckpointIndex) -> Any:
    if entry.key not in index.tensors:
        index.tensors[entry.key] = entry  # so views over it resolve
    return LazyTensor(entry)


def _nest(root: dict, path: tuple, value: Any) -> None:
    node = root
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


__all__ = ["zero_target_from_state", "config_precision"]
