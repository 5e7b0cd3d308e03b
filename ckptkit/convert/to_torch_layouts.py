"""The canonical state as torch's recipe names it, for DCP folders and torch.save files.

Keys are what `get_state_dict(model, optim)` flattened by DCP produces: `model.<name>`,
`optim.state.<name>.exp_avg|exp_avg_sq|step` (step a 0-d float32 tensor),
`optim.param_groups.<g>.<hyper>` with `params` as names. Frozen params and buffers of a
DeepSpeed source are upcast to float32 (FSDP keeps float32 masters); tied weights appear under
both names, as `model.state_dict()` lists them. DeepSpeed's own values come along under `ds.`
(global_steps, global_samples, skipped_steps, lr_scheduler, ds_config) and its client_state
keys at the top level.
"""
from __future__ import annotations

from ..index.dtypes import is_floating
from ..index.layouts import Assignment, Layout, chunk_dim0
from ..index.types import Box, CheckpointIndex, FlatRange, Location, ObjectEntry, Piece, TensorEntry
from ..index.virtual import REF, inline_tensor
from .hyper import torch_groups, torch_step
from .state import MOMENTS, TrainingState, flat_extras

SOURCE_PREFIX = "\0source:"  # keys of source tensors referenced by cast views (never written)


def _upcast_view(key: str, entry: TensorEntry, path: tuple, resolver: dict[str, TensorEntry]) -> TensorEntry:
    """`entry` read as float32 (a virtual tensor over the source tensor)."""
    ref = SOURCE_PREFIX + entry.key
    resolver[ref] = entry
    pieces = [Piece(FlatRange(0, entry.numel), Location(ref, 0, entry.numel, REF))] if entry.numel else []
    return TensorEntry(key, "float32", entry.shape, pieces, path=path, attrs={"virtual": True})


def _same(key: str, entry: TensorEntry, path: tuple) -> TensorEntry:
    return TensorEntry(key, entry.dtype, entry.shape, list(entry.pieces), path=path, attrs=dict(entry.attrs))


def torch_recipe_index(state: TrainingState, fmt: str) -> tuple[CheckpointIndex, dict[str, TensorEntry]]:
    """(index in torch's recipe keys, resolver = index tensors + the source tensors views refer to)."""
    index = CheckpointIndex(format=fmt, root="")
    resolver: dict[str, TensorEntry] = {}
    from_ds = state.optimizer_style == "deepspeed" or state.source.index.format == "deepspeed"
    for name, entry in state.model.items():
        key, path = f"model.{name}", ("model", name)
        if name in state.ties:
            entry = state.model[state.ties[name]]
        if from_ds and is_floating(entry.dtype) and entry.dtype != "float32":
            index.add_tensor(_upcast_view(key, entry, path, resolver))
        else:
            index.add_tensor(_same(key, entry, path))
    for name in state.trainable:
        for what in MOMENTS:
            entry = state.moments.get(name, {}).get(what)
            if entry is not None:
                index.add_tensor(_same(f"optim.state.{name}.{what}", entry, ("optim", "state", name, what)))
        if name in state.steps:
            key = f"optim.state.{name}.step"
            index.add_tensor(inline_tensor(key, torch_step(state.steps[name]), ("optim", "state", name, "step")))
    for g, (hyper, params) in enumerate(zip(torch_groups(state.groups, state.ds_config, from_ds),
                                            state.group_params)):
        for k, v in list(hyper.items()) + [("params", list(params))]:
            index.add_object(ObjectEntry(f"optim.param_groups.{g}.{k}", v, path=("optim", "param_groups", g, k)))
    for k, v in state.ds.items():
        for path, leaf in flat_extras([(("ds", k), v)]):
            index.add_object(ObjectEntry(".".join(map(str, path)), leaf, path=path))
    for path, value in flat_extras(state.extras):
        key = ".".join(map(str, path))
        if isinstance(value, TensorEntry):
            index.add_tensor(_same(key, value, path))
        else:
            index.add_object(ObjectEntry(key, value, path=path))
    resolver.update(index.tensors)
    return index, resolver


def fsdp2_training_layout(index: CheckpointIndex, state: TrainingState, world_size: int) -> Layout:
    """FSDP2 at `world_size`: every N-d parameter and its moments Shard(0) (torch.chunk);
    buffers, steps and 0-d values whole, written once by rank 0."""
    params = set(state.trainable) | set(state.frozen) | set(state.ties)
    layout = Layout(world_size, description=f"FSDP2 Shard(0) over {world_size} ranks")
    for key, entry in index.tensors.items():
        path = entry.path or ()
        sharded = (path[:1] == ("model",) and path[1] in params) or (
            path[:2] == ("optim", "state") and path[-1] in MOMENTS)
        if not sharded or not entry.shape:
            layout.tensors[key] = [Assignment(0, Box.whole(entry.shape))]
            continue
        boxes = chunk_dim0(entry.shape, world_size)
        assigns = [Assignment(r, b) for r, b in enumerate(boxes) if b.numel] or [Assignment(0, boxes[0])]
        layout.tensors[key] = assigns
    return layout
