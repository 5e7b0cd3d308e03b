"""The canonical state as torch's recipe names it, for DCP folders and torch.save files.

Keys are what `get_state_dict(model, optim)` flattened by DCP produces: `model.<name>`,
`optim.state.<name>.<key>` for every state key the optimizer keeps (exp_avg, momentum_buffer,
sum...; a step that DeepSpeed's own optimizer kept as an int becomes torch's 0-d float32 tensor),
`optim.param_groups.<g>.<hyper>` with `params` as names. Frozen params and buffers of a
DeepSpeed source are upcast to float32 (FSDP keeps float32 masters); tied weights appear under
both names, as `model.state_dict()` lists them. DeepSpeed's own values come along under `ds.`
(global_steps, global_samples, skipped_steps, lr_scheduler, ds_config) and its client_state
keys at the top level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import CkptkitError, UnsupportedError
from ..index.dtypes import is_floating
from ..index.layouts import Assignment, Layout, chunk_dim0
from ..index.mesh import PLAIN, Placement, mesh_layout
from ..index.state_keys import model_key, model_path, param_group_key, param_group_path, state_key, state_path
from ..index.types import Box, CheckpointIndex, FlatRange, Location, ObjectEntry, Piece, TensorEntry
from ..index.virtual import REF, inline_tensor
from ..formats.registry import capabilities_of
from ..runner.fetch import Fetcher
from ..lazy_torch import is_tensor
from ..torch_types import SmallTensor
from .hyper import torch_groups, torch_step
from .state import TrainingState, flat_extras

if TYPE_CHECKING:
    from ..index.parallel_spec import MeshSpec

SOURCE_PREFIX = "\0source:"  # keys of source tensors referenced by cast views (never written)


def view(
    key: str, entry: TensorEntry, resolver: dict[str, TensorEntry], path: tuple | None = None, dtype: str | None = None
) -> TensorEntry:
    """`entry` under a new key, read as `dtype`: its own pieces when there is nothing to cast
    (other dtype not given, or not floating), else a virtual tensor over it that the fetcher casts.
    One source entry gets one resolver key, so two views of it (a tied weight's two names) have
    the same pieces and are written once."""
    if dtype is None or dtype == entry.dtype or not is_floating(entry.dtype):
        return TensorEntry(key, entry.dtype, entry.shape, list(entry.pieces), path=path, attrs=dict(entry.attrs))
    ref = f"{SOURCE_PREFIX}{id(entry)}"  # the entry is kept alive by the resolver, so the id stays its own
    resolver[ref] = entry
    pieces = [Piece(FlatRange(0, entry.numel), Location(ref, 0, entry.numel, REF))] if entry.numel else []
    return TensorEntry(key, dtype, entry.shape, pieces, path=path, attrs={"virtual": True})


def fetcher_for(state: TrainingState, resolver: dict[str, TensorEntry]) -> Fetcher:
    """A fetcher over the source that resolves the views of `resolver`."""
    return Fetcher(state.source.source, index=CheckpointIndex("resolver", "", tensors=resolver))


def torch_recipe_index(state: TrainingState, fmt: str) -> tuple[CheckpointIndex, dict[str, TensorEntry]]:
    """(index in torch's recipe keys, resolver = index tensors + the source tensors views refer to)."""
    index = CheckpointIndex(format=fmt, root="")
    resolver: dict[str, TensorEntry] = {}
    from_ds = state.from_deepspeed
    for name, entry in state.model.items():
        entry = state.model[state.ties.get(name, name)]
        index.add_tensor(view(model_key(name), entry, resolver, model_path(name), "float32" if from_ds else None))
    own = state.source_own
    optim_names = [] if state.optimizer_dropped else state.trainable  # a dropped optimizer: no groups
    for name in dict.fromkeys(optim_names + list(state.param_states) + list(state.whole_states)):
        for what, entry in state.param_states.get(name, {}).items():
            index.add_tensor(view(state_key(name, what), entry, resolver, state_path(name, what)))
        for what, value in state.whole_states.get(name, {}).items():
            key, path = state_key(name, what), state_path(name, what)
            if what == "step" and own:
                value = torch_step(value)  # DeepSpeed's own int step: torch keeps a 0-d float32 tensor
            if isinstance(value, SmallTensor) or is_tensor(value):
                index.add_tensor(inline_tensor(key, value, path))
            else:
                index.add_object(ObjectEntry(key, value, path=path))
    src_opt = state.source_optimizer
    groups = (
        []
        if state.optimizer_dropped
        else torch_groups(state.groups, own, src_opt.adam_w_mode if src_opt is not None else True)
    )
    for g, (hyper, params) in enumerate(zip(groups, state.group_params)):
        for k, v in list(hyper.items()) + [("params", list(params))]:
            index.add_object(ObjectEntry(param_group_key(g, k), v, path=param_group_path(g, k)))
    for k, v in state.ds.items():
        for path, leaf in flat_extras([(("ds", k), v)]):
            index.add_object(ObjectEntry(".".join(map(str, path)), leaf, path=path))
    for path, value in flat_extras(state.extras):
        key = ".".join(map(str, path))
        if isinstance(value, TensorEntry):
            index.add_tensor(view(key, value, resolver, path))
        else:
            index.add_object(ObjectEntry(key, value, path=path))
    resolver.update(index.tensors)
    return index, resolver


def _parameter_of(entry: TensorEntry, state: TrainingState, params: set[str]) -> str | None:
    """The parameter an index tensor is (model.<p>) or is a partitioned state of (optim.state.<p>.<k>),
    which FSDP2 shards; None for buffers, steps and anything else (every rank holds it whole)."""
    path = entry.path or ()
    if path[:1] == ("model",) and len(path) == 2 and path[1] in params:
        return path[1]
    if path[:2] == ("optim", "state") and len(path) == 4 and path[3] in state.param_states.get(path[2], {}):
        return path[2]
    return None


def fsdp2_training_layout(index: CheckpointIndex, state: TrainingState, world_size: int) -> Layout:
    """FSDP2 at `world_size`: every N-d parameter and its partitioned state Shard(0) (torch.chunk);
    buffers, steps and 0-d values whole, written once by rank 0."""
    params = set(state.trainable) | set(state.frozen) | set(state.ties)
    layout = Layout(world_size, description=f"FSDP2 Shard(0) over {world_size} ranks")
    for key, entry in index.tensors.items():
        sharded = _parameter_of(entry, state, params) is not None
        if not sharded or not entry.shape:
            layout.tensors[key] = [Assignment(0, Box.whole(entry.shape))]
            continue
        boxes = chunk_dim0(entry.shape, world_size)
        assigns = [Assignment(r, b) for r, b in enumerate(boxes) if b.numel] or [Assignment(0, boxes[0])]
        layout.tensors[key] = assigns
    return layout


def recorded_tp(state: TrainingState, name: str) -> dict | None:
    """The tp split the source records for parameter `name` (attrs["parallel"]["tp"]: a tensor-parallel
    DeepSpeed checkpoint, or DCP saved with TP), or None when it records none."""
    entry = state.model.get(state.ties.get(name, name))
    if entry is None:
        entry = next(iter(state.param_states.get(name, {}).values()), None)
    tp = (entry.attrs.get("parallel") or {}).get("tp") if entry is not None else None
    return tp if isinstance(tp, dict) and "dim" in tp else None


def mesh_training_layout(
    index: CheckpointIndex,
    state: TrainingState,
    mesh: "MeshSpec",
    tp_dim_for: "Callable[[str, tuple[int, ...]], int | None] | None",
) -> tuple[Layout, list[str]]:
    """The training state on a device mesh as torch's dcp.save writes FSDP2 (+ HSDP, + TP) there
    (index/mesh.py): every N-d parameter and its partitioned states `Shard(0)` on dp_shard, and on tp
    the split the source records for it, else `tp_dim_for(name, shape)` (the split rules); buffers and
    steps plain, each item in the rank file torch's planner picks (for a state dict of the model and
    optimizer alone; the source's other values come after them). Also returns notes for the summary.

    A fused source split (Megatron's QKV, whose tp rank r holds [q_r; k_r; v_r]) is read as the full
    tensor [Q; K; V] (what consolidate writes) and laid out as torch's `Shard(dim)` of that tensor,
    which is what ColwiseParallel gives a fused weight; DTensor has no placement for Megatron's
    per-rank grouping, so a note says so."""
    params = set(state.trainable) | set(state.frozen) | set(state.ties)
    with_tp = mesh.size("tp") > 1
    dims: dict[str, int | None] = {}
    fused: list[str] = []
    how = {"recorded": 0, "rules": 0}
    placements: dict[str, Placement] = {}
    for key, entry in index.tensors.items():
        name = _parameter_of(entry, state, params)
        if name is None or not entry.shape:
            placements[key] = PLAIN
            continue
        if with_tp and name not in dims:
            recorded = recorded_tp(state, name)
            if recorded is not None:
                dims[name] = recorded["dim"]
                how["recorded"] += 1
                if recorded.get("fused"):
                    fused.append(name)
            elif tp_dim_for is None:
                raise UnsupportedError(
                    f"{name}: the source records no tensor-parallel split for it, so nothing "
                    f"says how tp splits it on {mesh}; give --tp-rules FILE"
                )
            else:
                shape = state.model[name].shape if name in state.model else entry.shape
                dims[name] = tp_dim_for(name, shape)
                how["rules"] += 1
        placements[key] = Placement(True, dims.get(name))
    # what the source holds beyond the model and optimizer (DeepSpeed's ds.* values, client state) is
    # placed last, so the model and optimizer items land in the files a torch job's own dcp.save of
    # get_state_dict puts them in
    layout = mesh_layout(
        index,
        mesh,
        placements,
        torch_state_order(index, state),
        late=lambda key: not key.startswith(("model.", "optim.")),
    )
    notes = []
    if with_tp:
        said = [f"{n} from the source's record" for n in (how["recorded"],) if n]
        said += [f"{n} from the split rules" for n in (how["rules"],) if n]
        notes.append(f"tp splits of {len(dims)} parameters: {', '.join(said) or 'none'}")
    if fused:
        names = ", ".join(fused[:3]) + (f" and {len(fused) - 3} more" if len(fused) > 3 else "")
        notes.append(
            f"{len(fused)} fused tensors ({names}) written whole as their consolidated blocks "
            f"[Q; K; V] and laid out as torch's Shard on tp of that tensor (what ColwiseParallel "
            f"gives a fused weight), not Megatron's per-rank [q_r; k_r; v_r] grouping"
        )
    return layout, notes


def torch_state_order(index: CheckpointIndex, state: TrainingState) -> list[str]:
    """The flat key order of `get_state_dict(model, optim)` as DCP's planner walks it (which decides
    the rank file of each replicated item): the model's keys, then per parameter its optimizer state
    with `step` first (torch's optimizers create it first), then the rest as the index lists it."""
    order = [k for k, e in index.tensors.items() if (e.path or ())[:1] == ("model",)]
    per_param: dict[str, list[str]] = {}
    for key, entry in list(index.tensors.items()) + list(index.objects.items()):
        path = tuple(entry.path or ())
        if path[:2] == ("optim", "state") and len(path) == 4:
            per_param.setdefault(path[2], []).append(key)
    for keys in per_param.values():
        order += sorted(
            keys,
            key=lambda k: (
                0 if (index.tensors[k].path if k in index.tensors else index.objects[k].path)[3] == "step" else 1
            ),
        )
    seen = set(order)
    rest = [k for k in list(index.tensors) + list(index.objects) if k not in seen]
    source_order = _saved_source_order(state)
    if source_order:  # a DCP source: its param groups' values in the order its own save walked them
        rest.sort(
            key=lambda k: (
                source_order.get(k, len(source_order)) if k.startswith("optim.param_groups.") else len(source_order)
            )
        )
    return order + rest


def _saved_source_order(state: TrainingState) -> dict[str, int]:
    """The source's flat keys by position in its saved state dict, where its format records that
    order (Capabilities.saved_key_order: DCP's planner data); {} for any other source."""
    saved_order = capabilities_of(state.source.index).saved_key_order
    if saved_order is None or state.source.trainer is not None:
        return {}
    try:
        return {k: i for i, k in enumerate(saved_order(state.source.source))}
    except CkptkitError:  # only an ordering hint: the index itself was read already
        return {}
