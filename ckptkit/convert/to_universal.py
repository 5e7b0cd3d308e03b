"""The canonical training state as a DeepSpeed universal checkpoint (`convert --to ds-universal`).

ds_to_universal's layout, whatever the source: each trainable parameter's fp32 master (float32,
as DeepSpeed keeps it), its optimizer tensors as the source keeps them and its step as the source
keeps it (DeepSpeed's Adam: an int); zero/optimizer_state.pt holds the param groups (the
engine copies their hyperparameters into its own groups) and the DeepSpeed version; the
model-states file holds the model as the source holds it (the engine does not load it, readers
do: frozen parameters and buffers are only there), the groups' members (`param_shapes`), the
ties, DeepSpeed's counters and the client state. Nothing is laid out per rank: DeepSpeed cuts
every tensor for its own dp (and tp) when it loads.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..errors import UnsupportedError, name_of
from ..formats.protocols import UniversalTarget
from ..index.types import CheckpointIndex, ObjectEntry, TensorEntry
from ..torch_types import Size
from .state import TrainingState, flat_extras
from .to_torch_layouts import fetcher_for, view

DS_FORMAT_VERSION = "0.19.8"  # the DeepSpeed release whose universal layout this writes
STEP = "step"
# the model-states keys the engine (or a reader) takes as DeepSpeed's own: a client key of one of
# these names would be overwritten, so it is refused
DS_OWN = (
    "module",
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
)


def universal_target_from_state(state: TrainingState, tag: str | None = None) -> UniversalTarget:
    """`state` laid out as ds_to_universal lays a ZeRO checkpoint out (module docstring)."""
    _refuse_without_groups(state)
    resolver: dict[str, TensorEntry] = {}
    params = {name: _param_states(state, name, resolver) for name in state.trainable}
    tag = tag or f"global_step{state.global_step or 0}_universal"
    models = _model_states(state, resolver)
    optimizer_state = _optimizer_state(state, params)
    resolver.update(models.tensors)
    return UniversalTarget(fetcher_for(state, resolver), params, models, optimizer_state, tag)


def _refuse_without_groups(state: TrainingState) -> None:
    """A universal checkpoint is the masters with their optimizer state, by param group: DeepSpeed
    loads each group's parameters while walking its own groups, so none may be guessed."""
    where = str(state.source.path)
    if state.optimizer_dropped or not (state.has_optimizer or state.param_states or state.whole_states):
        raise UnsupportedError(
            f"{where}: has no optimizer state; a DeepSpeed universal checkpoint is the parameters' fp32 "
            f"masters with their optimizer state, grouped by param group"
        )
    if not state.has_optimizer:
        raise UnsupportedError(
            f"{where}: its optimizer state has no param groups (which parameters each group holds, with "
            f"its hyperparameters), which DeepSpeed's universal loader walks to load every parameter; "
            f"convert a checkpoint that keeps them (DCP, torch.save or DeepSpeed)"
        )


def _param_states(state: TrainingState, name: str, resolver: dict[str, TensorEntry]) -> dict[str, Any]:
    """{"fp32": master as float32, <tensor states>..., "step": number} of one trainable parameter."""
    master = state.model[state.ties.get(name, name)]
    states: dict[str, Any] = {"fp32": view(f"{name}/fp32", master, resolver, dtype="float32")}
    for key, entry in state.param_states.get(name, {}).items():
        states[str(key)] = view(f"{name}/{key}", entry, resolver)
    for key, value in state.whole_states.get(name, {}).items():
        if key != STEP:
            raise UnsupportedError(
                f"parameter {name_of(name)}: optimizer value {name_of(str(key))} is neither a tensor "
                f"shaped like the parameter nor its step, which is all DeepSpeed's universal loader reads"
            )
        states[STEP] = value
    return states


def _optimizer_state(state: TrainingState, params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """zero/optimizer_state.pt: what ZeRO 1/2 and bf16 (`param_groups`, `ds_version`) and ZeRO 3
    (`optimizer_state_dict.state[0].step`, `.param_groups`) read back."""
    groups = [dict(g, params=[i]) for i, g in enumerate(state.groups)]
    steps = [p[STEP] for p in params.values() if STEP in p]
    osd: dict[str, Any] = {"state": {0: {STEP: steps[0]}} if steps else {}, "param_groups": groups}
    return {
        "ds_version": _optimizer_version(state),
        "param_groups": groups,
        "optimizer_state_dict": osd,
    }


def _model_states(state: TrainingState, resolver: dict[str, TensorEntry]) -> CheckpointIndex:
    """mp_rank_00_model_states.pt as an index: the module, its records, DeepSpeed's values, the client state."""
    index = CheckpointIndex(format="ds_universal", root="")
    for name, entry in state.model.items():
        src = state.model[state.ties.get(name, name)]
        index.add_tensor(view(f"module.{name}", src, resolver, ("module", name)))
    values: dict[str, Any] = OrderedDict()
    values["buffer_names"] = list(state.buffers)
    values["param_shapes"] = [OrderedDict((n, Size(state.model[n].shape)) for n in g) for g in state.group_params]
    values["frozen_param_shapes"] = OrderedDict((n, Size(state.model[n].shape)) for n in state.frozen)
    values["shared_params"] = dict(state.ties)
    values["lr_scheduler"] = state.ds.get("lr_scheduler")
    values["data_sampler"] = state.ds.get("data_sampler")
    values["random_ltd"] = state.ds.get("random_ltd")
    values["skipped_steps"] = state.ds.get("skipped_steps", 0)
    values["global_steps"] = state.global_step or 0
    if "global_samples" in state.ds:
        values["global_samples"] = state.ds["global_samples"]
    values["dp_world_size"] = state.source.index.world_size or 1
    values["mp_world_size"] = 1
    if isinstance(state.ds_config, dict):
        values["ds_config"] = state.ds_config
    values["ds_version"] = _optimizer_version(state)
    for key, value in values.items():
        index.add_object(ObjectEntry(key, value, path=(key,)))
    _add_extras(index, state, resolver)
    return index


def _optimizer_version(state: TrainingState) -> str:
    version = state.ds.get("ds_version")
    return version if isinstance(version, str) else DS_FORMAT_VERSION


def _add_extras(index: CheckpointIndex, state: TrainingState, resolver: dict[str, TensorEntry]) -> None:
    """The client state at the top level, where DeepSpeed hands it back from load_checkpoint."""
    for path, value in flat_extras(state.extras):
        if str(path[0]) in DS_OWN:
            raise UnsupportedError(
                f"client value {name_of('.'.join(map(str, path)))}: its name is one of DeepSpeed's own "
                f"model-states keys, which a universal checkpoint's loader reads as DeepSpeed's"
            )
        key = ".".join(map(str, path))
        if isinstance(value, TensorEntry):
            index.add_tensor(view(key, value, resolver, tuple(path)))
        else:
            index.add_object(ObjectEntry(key, value, path=tuple(path)))
