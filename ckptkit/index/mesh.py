"""DCP on a device mesh: the chunks torch's `dcp.save` writes for FSDP2 (+ HSDP, + TP) on a mesh.

For each tensor and each rank, the box is what DTensor's `compute_local_shape_and_global_offset`
gives for the tensor's placements (ported here, so writing needs no torch):

- a parameter (and each optimizer state of it) is `Shard(0)` on dp_shard (FSDP2), or, when TP
  also shards its dim 0 (ColwiseParallel), `_StridedShard(0, split_factor=tp)`: torch.chunk of
  the TP-local rows; `Replicate()` on dp_replicate (HSDP); `Shard(d)` or `Replicate()` on tp;
- any other tensor (a buffer, AdamW's 0-d `step`) is a plain tensor every rank holds whole;
- an empty local shard is recorded at offset = the dimension's size, as torch records it.

Which rank's file holds a chunk several ranks hold (replicated on dp_replicate or tp, plain
tensors, bytes values) is decided as DCP's DefaultSavePlanner decides it
(`_dedup_save_plans.dedup_save_plans`): walking the items rank by rank in state-dict order, each
goes to the holder whose plan is smallest so far. `mesh_layout` reproduces that walk, so a
resharded folder has torch's chunk list, each chunk in torch's rank file.

Reading a source saved on a mesh: DCP does not record the mesh, so `infer_source_mesh` tries
every (dp_replicate, dp_shard, tp) that multiplies to the world size and keeps the one under
which every tensor's chunks (boxes, and the rank files holding them) are what torch would write;
`source_placements` then says for each tensor whether and on which dim tp splits it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Sequence

from ..errors import UnsupportedError, UsageError
from .dtypes import itemsize
from .layouts import Assignment, Layout
from .parallel_spec import MESH_DIMS, MeshSpec
from .types import Box, CheckpointIndex, TensorEntry

OPTIM_STATE = "optim.state."
MODEL = "model."


@dataclass(frozen=True)
class Placement:
    """How one tensor lies on a mesh: `param` (FSDP2-sharded on dp_shard, replicated on
    dp_replicate) with `tp_dim` (None: replicated on tp), or a plain tensor every rank holds whole."""

    param: bool
    tp_dim: int | None = None


PLAIN = Placement(False)


# ------------------------------------------------------------------ DTensor's local chunk, ported


def _torch_chunk(indices: Sequence[int], k: int) -> list[Sequence[int]]:
    """torch.chunk's k pieces of `indices` (ceil-sized, empty pieces at the end)."""
    n = len(indices)
    step = -(-n // k) if n else 0
    return [indices[i * step : (i + 1) * step] if step else indices[0:0] for i in range(k)]


def _torch_chunk_piece(indices: Sequence[int], k: int, i: int) -> Sequence[int]:
    """_torch_chunk(indices, k)[i] without building the other k - 1 pieces (a mesh of many ranks
    would otherwise cost ranks x ranks per tensor)."""
    n = len(indices)
    step = -(-n // k) if n else 0
    return indices[i * step : (i + 1) * step] if step else indices[0:0]


@lru_cache(maxsize=4096)
def _strided_indices(n: int, k: int, rank: int, split_factor: int) -> tuple[int, ...]:
    """_StridedShard(split_factor).local_shard_size_and_offset(ALL): chunk into split_factor
    pieces, each into k; rank `rank` gets its piece of every one, in order."""
    out: list[int] = []
    for first in _torch_chunk(range(n), split_factor):
        out.extend(_torch_chunk_piece(first, k, rank))
    return tuple(out)


def mesh_placements(mesh: MeshSpec, placement: Placement) -> list[tuple[str, int, int]]:
    """Per mesh dim: ("R", 0, 0), ("S", dim, 0) or ("SS", dim, split_factor), as FSDP2 + TP set
    them (FSDP2 uses _StridedShard on dp_shard when tp also shards dim 0)."""
    tp = mesh.size("tp")
    out = []
    for name, _ in mesh.dims:
        if not placement.param or name == "dp_replicate":
            out.append(("R", 0, 0))
        elif name == "dp_shard":
            out.append(("SS", 0, tp) if placement.tp_dim == 0 and tp > 1 else ("S", 0, 0))
        elif placement.tp_dim is None:  # tp
            out.append(("R", 0, 0))
        else:
            out.append(("S", placement.tp_dim, 0))
    return out


def local_box(shape: tuple[int, ...], mesh: MeshSpec, rank: int, placement: Placement, key: str = "") -> Box:
    """The chunk rank `rank` holds: torch's `_compute_local_shape_and_global_offset`."""
    coords = mesh.coordinates(rank)
    local = list(shape)
    offsets: dict[int, Sequence[int]] = {}
    for (name, size), (kind, dim, split) in zip(mesh.dims, mesh_placements(mesh, placement)):
        if kind == "R" or len(shape) == 0:
            continue
        n, me = local[dim], coords[name]
        idx: Sequence[int] = (
            _strided_indices(n, size, me, split) if kind == "SS" else _torch_chunk_piece(range(n), size, me)
        )
        if len(idx) == 0:
            offsets[dim] = range(shape[dim], shape[dim] + 1)  # torch's offset of an empty shard
            local[dim] = 0
            continue
        prev = offsets.get(dim)
        offsets[dim] = (
            idx if prev is None else (prev[idx.start : idx.stop] if isinstance(idx, range) else [prev[i] for i in idx])
        )
        local[dim] = len(idx)
    starts = [0] * len(shape)
    for dim, idx in offsets.items():
        starts[dim] = idx[0]
        if local[dim] and idx[-1] - idx[0] + 1 != local[dim]:
            raise UnsupportedError(
                f"{key}: on {mesh} rank {rank} holds rows that are not contiguous, which DCP cannot record as one chunk"
            )
    return Box(tuple(starts), tuple(local))


def rank_boxes(shape: tuple[int, ...], mesh: MeshSpec, placement: Placement, key: str = "") -> list[Box]:
    """Every rank's box (ranks that differ only on dims the placement replicates share one);
    remembered per (shape, mesh, placement): a model has few distinct ones."""
    try:
        return _rank_boxes(shape, mesh, placement)
    except UnsupportedError:
        return list(_rank_boxes.__wrapped__(shape, mesh, placement, key))  # raises, naming the tensor


@lru_cache(maxsize=1024)
def _rank_boxes(shape: tuple[int, ...], mesh: MeshSpec, placement: Placement, key: str = "") -> list[Box]:
    if not placement.param:
        whole = Box.whole(shape)
        return [whole] * mesh.world_size
    kinds = mesh_placements(mesh, placement)
    out: list[Box] = []
    seen: dict[tuple[int, ...], Box] = {}
    for rank in range(mesh.world_size):
        coords = mesh.coordinates(rank)
        sig = tuple(coords[name] for (name, _), (k, _, _) in zip(mesh.dims, kinds) if k != "R")
        if sig not in seen:
            seen[sig] = local_box(shape, mesh, rank, placement, key)
        out.append(seen[sig])
    return out


# ------------------------------------------------------------------ torch's dedup of replicated items


@dataclass
class _Item:
    key: str
    box: Box | None  # None: a bytes value
    size: int


def dedup_owners(
    plans: list[list[_Item]], planned: list[int] | None = None
) -> dict[tuple[str, tuple[int, ...] | None], int]:
    """dedup_save_plans(save_to_lowest_rank=False): each item to the holder with the smallest
    planned storage so far (ties: the first in the set's order, as torch's `min` over a set of
    ranks), items visited in first-appearance order (rank 0's plan first). `planned`: each rank's
    storage planned before these items (updated in place; None: nothing yet)."""
    holders: dict[tuple[str, tuple[int, ...] | None], set[int]] = {}
    sizes: dict[tuple[str, tuple[int, ...] | None], int] = {}
    for rank, plan in enumerate(plans):
        for item in plan:
            ident = (item.key, item.box.offsets if item.box is not None else None)
            holders.setdefault(ident, set()).add(rank)
            sizes[ident] = item.size
    if planned is None:
        planned = [0] * len(plans)
    owners = {}
    for ident, ranks in holders.items():
        chosen = min(ranks, key=lambda r: planned[r])
        planned[chosen] += sizes[ident] or 1
        owners[ident] = chosen
    return owners


# ------------------------------------------------------------------ the layout of a target mesh


def param_name(key: str, index: CheckpointIndex) -> str | None:
    """The parameter a key belongs to (`model.<p>` or `optim.state.<p>.<state>`, read from the
    entry's nesting, since names contain dots), else None."""
    entry = index.tensors.get(key)
    path = tuple(entry.path) if entry is not None and entry.path else ()
    if len(path) == 2 and path[0] == "model":
        return path[1]
    if len(path) == 4 and path[:2] == ("optim", "state"):
        return path[2]
    return None


def mesh_layout(
    index: CheckpointIndex,
    mesh: MeshSpec,
    placements: dict[str, Placement],
    order: Sequence[str],
    late: Callable[[str], bool] | None = None,
) -> Layout:
    """Each tensor's chunks on `mesh`, each in the rank file torch's planner puts it in; each
    value (bytes item) on the rank torch puts it. `order` is the state dict's flattened key order
    (tensors and values), which is the order torch's planner visits items in.

    `late(key)`: items placed after all the others, as if saved by a second dcp.save: the others
    then land exactly where a job whose state dict lacks the late ones puts them (convert: a torch
    job saves get_state_dict's model and optimizer, not DeepSpeed's own values that ckptkit keeps)."""
    check_mesh(mesh)
    keys = [k for k in order if k in index.tensors or k in index.objects]
    keys += [k for k in list(index.tensors) + list(index.objects) if k not in set(keys)]
    boxes: dict[str, list[Box]] = {}
    by_kind: dict[tuple[tuple[int, ...], Placement], list[Box]] = {}  # tensors of one shape share boxes
    for key, entry in index.tensors.items():
        p = placements.get(key, PLAIN)
        kind = (entry.shape, p)
        if kind not in by_kind:
            by_kind[kind] = rank_boxes(entry.shape, mesh, p, key)
        boxes[key] = by_kind[kind]
    # torch counts a chunk as its whole tensor's bytes (WriteItem.tensor_storage_size uses the
    # global size), and a value as nothing: dedup_save_plans then counts it as 1
    sizes = {key: _numel(entry.shape) * itemsize(entry.dtype) for key, entry in index.tensors.items()}
    planned = [0] * mesh.world_size
    owners: dict[tuple[str, tuple[int, ...] | None], int] = {}
    first = [k for k in keys if late is None or not late(k)]
    for part in (first, [k for k in keys if late is not None and late(k)]):
        plans: list[list[_Item]] = []
        for rank in range(mesh.world_size):
            plan = []
            for key in part:
                if key in index.tensors:
                    box = boxes[key][rank]
                    plan.append(_Item(key, box, sizes[key]))
                else:
                    plan.append(_Item(key, None, 0))
            plans.append(plan)
        owners.update(dedup_owners(plans, planned))
    layout = Layout(mesh.world_size, description=f"DCP on {mesh}", object_ranks={}, exact_chunks=True, key_order=keys)
    for key in keys:
        if key in index.objects:
            layout.object_ranks[key] = owners[(key, None)]
            continue
        seen: dict[tuple[int, ...], Assignment] = {}
        for rank in range(mesh.world_size):
            box = boxes[key][rank]
            if box.offsets not in seen:
                seen[box.offsets] = Assignment(owners[(key, box.offsets)], box)
        layout.tensors[key] = sorted(seen.values(), key=lambda a: a.rank)
    return layout


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_mesh(mesh: MeshSpec) -> None:
    """FSDP2 + TP as torchtitan builds it: dims in the order dp_replicate, dp_shard, tp."""
    ranks = [MESH_DIMS.index(n) for n in mesh.names]
    if ranks != sorted(ranks):
        raise UsageError(
            f"{mesh}: give the mesh dimensions in the order {', '.join(MESH_DIMS)} "
            f"(the order torchtitan's init_device_mesh uses)"
        )


# ------------------------------------------------------------------ placements: source and target


def _owner_rank(entry: TensorEntry, piece_index: int) -> int | None:
    """The rank whose `__{rank}_0.distcp` file holds a piece, if the file is named that way."""
    return _rank_of_file(entry.pieces[piece_index].location.file)


@lru_cache(maxsize=65536)
def _rank_of_file(name: str) -> int | None:
    name = str(name)
    if name.startswith("__") and name.endswith(".distcp"):
        try:
            return int(name[2:].split("_")[0])
        except ValueError:
            return None
    return None


def _fits(entry: TensorEntry, mesh: MeshSpec, placement: Placement) -> bool:
    """Whether the entry's chunks are exactly what torch writes for `placement` on `mesh`: the
    same non-empty boxes, each in the file of a rank that holds it."""
    shape = entry.shape
    holders: dict[Box, set[int]] = {}
    for r, box in enumerate(rank_boxes(shape, mesh, placement, entry.key)):
        holders.setdefault(box, set()).add(r)
    want = {b for b in holders if b.numel}
    got = {}
    for i, piece in enumerate(entry.pieces):
        if not isinstance(piece.region, Box) or piece.region.numel == 0:
            continue
        got[piece.region] = _owner_rank(entry, i)
    if set(got) != want:
        return False
    return all(owner is None or owner in holders[box] for box, owner in got.items())


def _candidates(entry: TensorEntry, mesh: MeshSpec) -> list[Placement]:
    options = (
        [PLAIN]
        if len(entry.shape) == 0
        else [Placement(True, None)] + [Placement(True, d) for d in range(len(entry.shape))] + [PLAIN]
    )
    if mesh.size("tp") == 1:
        options = [p for p in options if p.tp_dim is None]
    try:
        return [p for p in options if _fits(entry, mesh, p)]
    except UnsupportedError:
        return []


def _groups(index: CheckpointIndex) -> dict[str, list[str]]:
    """Keys grouped by parameter (model.<p> with its optimizer states); others alone."""
    groups: dict[str, list[str]] = {}
    for key in index.tensors:
        name = param_name(key, index)
        groups.setdefault(name if name is not None else "\0" + key, []).append(key)
    return groups


def source_placements(index: CheckpointIndex, mesh: MeshSpec) -> dict[str, Placement] | None:
    """Each tensor's placement on the source mesh, decided per parameter (a parameter and its
    optimizer states share one), or None when some tensor fits no placement on `mesh`."""
    out: dict[str, Placement] = {}
    for name, keys in _groups(index).items():
        common: list[Placement] | None = None
        for key in keys:
            entry = index.tensors[key]
            if len(entry.shape) == 0:
                if not _candidates(entry, mesh):
                    return None
                out[key] = PLAIN
                continue
            cands = _candidates(entry, mesh)
            common = cands if common is None else [p for p in common if p in cands]
        if common is None:
            continue
        if not common:
            return None
        is_param = not name.startswith("\0") and any(k.startswith(OPTIM_STATE) for k in keys)
        chosen = _prefer(common, is_param)
        for key in keys:
            if len(index.tensors[key].shape):
                out[key] = chosen
    return out


def _prefer(cands: list[Placement], is_param: bool) -> Placement:
    """Among placements whose boxes all fit (only a tensor too small to tell): a parameter (it
    has optimizer state) over a plain tensor, tp-replicated over a split, a lower split dim first."""
    params = [p for p in cands if p.param]
    if params and (is_param or PLAIN not in cands):
        return min(params, key=lambda p: -1 if p.tp_dim is None else p.tp_dim)
    return PLAIN


def infer_source_mesh(index: CheckpointIndex) -> tuple[MeshSpec, dict[str, Placement]]:
    """The (dp_replicate, dp_shard, tp) mesh the source was saved on, with its placements: the
    first, fewest tp then fewest dp_replicate, under which every tensor's chunks are torch's."""
    world = index.world_size or 1
    for tp in _divisors(world):
        for rep in _divisors(world // tp):
            shard = world // tp // rep
            dims = tuple((n, s) for n, s in (("dp_replicate", rep), ("dp_shard", shard), ("tp", tp)) if s > 1)
            mesh = MeshSpec(dims or (("dp_shard", 1),))
            placements = source_placements(index, mesh)
            if placements is not None:
                return mesh, placements
    raise UnsupportedError(
        f"{index.root}: its chunks are not what FSDP2/HSDP/TP on any (dp_replicate, dp_shard, "
        f"tp) mesh of {world} ranks writes; give the source mesh with --from mesh=..."
    )


def _divisors(n: int) -> Iterable[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def placements_by_role(index: CheckpointIndex) -> dict[str, Placement]:
    """Placements for a source whose chunks fit no mesh (cut into slabs, FSDP1's flat shards...):
    a parameter (a tensor with optimizer state, or split across ranks) and its states are FSDP2
    parameters with no tp split; anything else is plain. Only a target with tp needs more (rules)."""
    out: dict[str, Placement] = {}
    for name, keys in _groups(index).items():
        is_param = not name.startswith("\0") and (
            any(k.startswith(OPTIM_STATE) for k in keys) or any(len(index.tensors[k].pieces) > 1 for k in keys)
        )
        for key in keys:
            out[key] = Placement(True, None) if is_param and index.tensors[key].shape else PLAIN
    return out


def target_placements(
    index: CheckpointIndex,
    source: dict[str, Placement],
    source_mesh: MeshSpec,
    target: MeshSpec,
    tp_dim_for: Callable[[str, tuple[int, ...]], int | None] | None,
) -> dict[str, Placement]:
    """The target's placements: the source's where the source had tp; where it had none and the
    target has tp, `tp_dim_for(parameter name, shape)` (split rules) decides for each parameter."""
    if target.size("tp") == 1 or source_mesh.size("tp") > 1:
        return dict(source)
    if tp_dim_for is None:
        raise UnsupportedError(
            f"{index.root}: was saved without tensor parallelism, so nothing in it says how tp "
            f"splits each tensor for {target}; give --tp-rules FILE"
        )
    out = {}
    for key, p in source.items():
        name = param_name(key, index)
        if not p.param or name is None:
            out[key] = p
            continue
        model_entry = index.tensors.get(MODEL + name)
        shape = model_entry.shape if model_entry is not None else index.tensors[key].shape
        out[key] = Placement(True, tp_dim_for(name, shape))
    return out


def annotate(index: CheckpointIndex) -> MeshSpec | None:
    """Mark a DCP index saved on a 2-D/3-D mesh (HSDP, FSDP2 + TP) for `inspect`: the inferred
    mesh in `metadata["mesh"]`; with tp, the sizes in `metadata["parallel"]` (tp, dp) and each
    parameter's and optimizer state's `attrs["parallel"]["tp"]` (dim None: replicated). A folder
    that is plain FSDP2 `Shard(0)` (checked first, cheaply) or fits no mesh is left as it is."""
    world = index.world_size or 1
    if world < 2 or not index.tensors:
        return None
    if _plain_fsdp2(index, world):
        return None
    try:
        found, placements = infer_source_mesh(index)
    except UnsupportedError:
        return None
    tp = found.size("tp")
    if tp == 1 and found.size("dp_replicate") == 1:
        return None
    if tp > 1:
        index.metadata["parallel"] = {"tp": tp, "dp": found.size("dp_replicate") * found.size("dp_shard")}
    index.metadata["mesh"] = str(found)[len("mesh=") :]
    if tp > 1:
        for key, p in placements.items():
            if p.param:
                index.tensors[key].attrs["parallel"] = {"tp": {"dim": p.tp_dim, "size": tp}}
    return found


def _plain_fsdp2(index: CheckpointIndex, world: int) -> bool:
    """Every tensor whole in one chunk, or FSDP2's Shard(0) at `world` with chunk r in rank r's file:
    the common 1-D case, told in one pass (the mesh search is for the rest)."""
    for entry in index.tensors.values():
        pieces, shape = entry.pieces, entry.shape
        if len(pieces) == 1 and isinstance(pieces[0].region, Box) and pieces[0].region.sizes == shape:
            continue
        if not shape:
            return False
        d0 = shape[0]
        step = -(-d0 // world)
        for i, piece in enumerate(pieces):
            region = piece.region
            if not isinstance(region, Box):
                return False
            if not region.numel:
                continue
            rank = _owner_rank(entry, i)
            if (
                rank is None
                or region.offsets[0] != rank * step
                or region.sizes[0] != min(step, d0 - rank * step)
                or any(region.offsets[1:])
                or region.sizes[1:] != shape[1:]
            ):
                return False
    return True
