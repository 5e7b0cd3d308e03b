"""The join over tp: full tensors from the tp ranks' lanes (read.py's last join).

A TP checkpoint is `tp` ordinary ZeRO checkpoints side by side (`model_file(XX)`, optim
files per (dp, mp) rank); a 3-D one (Megatron-DeepSpeed's PipeModelDataParallelTopology) is `tp`
pipelines side by side, tp rank t's files (stage s: mp rank s * tp + t, layer files
`tp_suffix(t)`) read and joined over pp first. The reader reads each lane and `join` joins them:
every parameter's master, optimizer state and module weight becomes one tensor of the full model's
shape whose pieces point straight into the rank files (no hidden per-rank entries).

Where each rank's slice lies in the full tensor (split along a dimension, fused blocks such as
Megatron's QKV, or replicated: rank 0's pieces) is tp_geometry.py's `TpGeometry`, the one
description the writers split with too. The other ranks' copies of a replicated tensor must be the
same bytes, which `verify --deep` checks (`DeepSpeedNative.replica_entries`). Copies of another
shape are refused; so are copies of other bytes where a `--tp-rules` rule of the user declared the
tensor replicated (a rule naming a split tensor would give rank 0's slice as the whole): those
copies are read and compared here, the only tensor payload this reader reads.

The split of each parameter comes first from what the checkpoint records
(`universal_checkpoint_info`: Megatron-DeepSpeed's or AutoTP's pattern lists), then from the split
rules (ckptkit/convert/tp_rules.py: --tp-rules FILE, then the built-in ones); a parameter no rule
decides is refused by name. Each assembled tensor carries attrs["parallel"]["tp"] = {"dim", "size"}.
"""

from __future__ import annotations

import math
from typing import Any

from ...convert.tp_rules import HOW_TO, TpRules, TpSplit, recorded_rules
from ...errors import FormatError, UnsupportedError, quote
from ...index.dtypes import itemsize
from ...index.types import CheckpointIndex, Piece, TensorEntry
from ...runner.fetch import Fetcher
from ...storage import kernel_copy
from ...storage.source import Source
from .files import ZeroFiles
from .info import ZeroInfo
from .layout import LAYER_FILES, DeepSpeedLayout
from .names import mp_rank
from .native import Copies
from .tp_geometry import for_slices, for_uneven_slices, param_name

COMPARE_ELEMENTS_BYTES = 16 << 20  # bytes of each copy compared at a time (user-declared replicas)


def join(
    source: Source,
    files: ZeroFiles,
    layout: DeepSpeedLayout,
    lanes: dict[int, CheckpointIndex],
    cell0: ZeroInfo,
    rules: TpRules,
    label: str,
) -> tuple[CheckpointIndex, dict[str, TpSplit], Copies]:
    """The full model's index from tp rank t's lane lanes[t] (one ZeRO cell, or a pipeline of
    them when the stages are layer files), with the splits it decided and the tp ranks' copies of
    replicated tensors. `cell0`: the (0, 0) cell, whose model-states file records the tp size."""
    tp = len(lanes)
    first = lanes[0]
    pipelined = layout.stages == LAYER_FILES
    if not pipelined:
        _check_recorded_tp(cell0, tp, label)
    uc = first.objects.get("ds.universal_checkpoint_info")
    recorded = recorded_rules(uc.data if uc is not None else None, label)
    chain = recorded.then(rules) if recorded is not None else rules
    index = CheckpointIndex(format=first.format, root=first.root, world_size=tp * first.world_size)
    for sub in lanes.values():
        index.files.update(sub.files)
        index.checks.extend(sub.checks)
    splits: dict[str, TpSplit] = {}
    replicas: Copies = {}
    aliases = []
    declared = set() if pipelined else _user_replicated(rules)
    to_compare: list[tuple[str, TpSplit]] = []
    for key, e0 in first.tensors.items():
        if "alias_of" in e0.attrs:
            aliases.append(e0)
            continue
        if pipelined:
            entries = [_same_lane_entry(lanes, t, key, e0, label) for t in range(tp)]
        else:
            entries = [_same_entry(lanes, r, key, e0, files, source) for r in range(tp)]
        name = param_name(e0)
        full = full_entry(entries, name, first, chain, splits, tp, label)
        index.add_tensor(full)
        if full.attrs["parallel"]["tp"]["dim"] is None:
            replicas[key] = list(enumerate(entries))[1:]
            split = splits.get(name) if name is not None else None
            if split is not None and id(split) in declared:
                to_compare.append((key, split))
    _check_declared_replicas(source, index, to_compare, replicas, label)
    _add_aliases(index, aliases)
    for key, obj in first.objects.items():
        index.add_object(obj)
    index.step = first.step
    (_pipeline_metadata if pipelined else _metadata)(index, first, tp)
    return index, splits, replicas


def _add_aliases(index: CheckpointIndex, aliases: list[TensorEntry]) -> None:
    """Tied parameters (shared_params) as aliases of their owner's full tensor."""
    for e0 in aliases:
        owner = index.tensors.get(e0.attrs["alias_of"])
        if owner is not None:
            index.add_tensor(
                TensorEntry(
                    e0.key,
                    owner.dtype,
                    owner.shape,
                    list(owner.pieces),
                    path=e0.path,
                    attrs={**e0.attrs, "parallel": owner.attrs.get("parallel")},
                )
            )


def _metadata(index: CheckpointIndex, first: CheckpointIndex, tp: int) -> None:
    """tp ZeRO cells: the mp world size, and the sizes (tp, the cells' ep, dp)."""
    dp = int(first.metadata.get("deepspeed", {}).get("world_size") or first.world_size or 1)
    index.metadata.update({k: v for k, v in first.metadata.items() if k != "deepspeed"})
    index.metadata["deepspeed"] = {**first.metadata.get("deepspeed", {}), "mp_world_size": tp}
    index.metadata["parallel"] = {
        "tp": tp,
        **({"ep": first.metadata["parallel"]["ep"]} if "ep" in first.metadata.get("parallel", {}) else {}),
        "dp": dp,
    }


def _pipeline_metadata(index: CheckpointIndex, first: CheckpointIndex, tp: int) -> None:
    """tp pipelines: the world and mp world sizes over pp x tp, the pipeline's tensor-parallel size."""
    pp, dp = first.metadata["parallel"]["pp"], first.metadata["parallel"]["dp"]
    index.metadata.update({k: v for k, v in first.metadata.items() if k not in ("deepspeed", "parallel")})
    ds = dict(first.metadata.get("deepspeed", {}))
    index.metadata["deepspeed"] = {
        **ds,
        "world_size": pp * tp * dp,
        "mp_world_size": pp * tp,
        "pipeline": {**ds.get("pipeline", {}), "tensor_parallel": tp},
    }
    index.metadata["parallel"] = {"pp": pp, "tp": tp, "dp": dp}


def _same_lane_entry(lanes: dict[int, CheckpointIndex], t: int, key: str, e0: TensorEntry, label: str) -> TensorEntry:
    """tp rank t's pipeline holds `key` as rank 0's does: dtype, rank and pipeline stage."""
    entry = lanes[t].tensors.get(key)
    if entry is None:
        raise FormatError(f"{label}: tensor-parallel rank {t}'s pipeline has no {key} (rank 0's has it)")
    if entry.dtype != e0.dtype or len(entry.shape) != len(e0.shape):
        raise FormatError(
            f"{label}: {key} is {entry.dtype} {list(entry.shape)} on tensor-parallel rank {t}, "
            f"{e0.dtype} {list(e0.shape)} on rank 0"
        )
    if e0.attrs.get("parallel", {}).get("pp") != entry.attrs.get("parallel", {}).get("pp"):
        raise FormatError(
            f"{label}: {key} is on pipeline stage {entry.attrs['parallel']['pp']['stage']} for "
            f"tensor-parallel rank {t} but stage {e0.attrs['parallel']['pp']['stage']} for rank 0"
        )
    return entry


def _check_recorded_tp(cell0: ZeroInfo, tp: int, label: str) -> None:
    """The tensor-parallel size the model-states file records must be the number of mp rank files:
    with ranks lost (a 4-way checkpoint copied with 2 of them) the slices would join into tensors of
    the wrong shape without a word."""
    states = cell0.model_states
    m0 = states.get(min(states)) if states else None
    if not isinstance(m0, dict):
        return
    dims = m0.get("checkpoint_parallel_dimensions")
    recorded, key = (
        (dims.get("tp_degree"), "checkpoint_parallel_dimensions.tp_degree")
        if isinstance(dims, dict) and "tp_degree" in dims
        else (m0.get("mp_world_size"), "mp_world_size")
    )
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded != tp:
        raise FormatError(
            f"{label}: {key} says the tensor-parallel size is {recorded}, but the tag folder has "
            f"model-states files of {tp} mp ranks ({mp_rank(0)}..{mp_rank(tp - 1)})"
        )


def _same_entry(
    subs: dict[int, CheckpointIndex], rank: int, key: str, e0: TensorEntry, files: ZeroFiles, source: Source
) -> TensorEntry:
    entry = subs[rank].tensors.get(key)
    where = source.label(
        files.prefix + files.model_parallel[rank].optim_files[min(files.model_parallel[rank].optim_files)]
    )
    if entry is None:
        raise FormatError(f"{where}: model-parallel rank {rank} has no {key} (rank 0 has it)")
    if entry.dtype != e0.dtype or len(entry.shape) != len(e0.shape):
        raise FormatError(
            f"{where}: {key} is {entry.dtype} {list(entry.shape)} on model-parallel rank {rank}, "
            f"{e0.dtype} {list(e0.shape)} on rank 0"
        )
    return entry


def full_entry(
    entries: list[TensorEntry],
    name: str | None,
    first: CheckpointIndex,
    rules: TpRules,
    splits: dict[str, TpSplit],
    tp: int,
    label: str,
) -> TensorEntry:
    e0 = entries[0]
    param = first.tensors.get(f"model.{name}") if name is not None else None
    shaped_like_param = param is not None and tuple(param.shape) == tuple(e0.shape) and len(e0.shape) > 0
    if not shaped_like_param and not (name is not None and e0.key.startswith("ds_module.")):
        return _with_tp(e0, list(e0.pieces), e0.shape, None, tp)  # a whole value (a 0-d step): as rank 0's
    split = splits.get(name) or _decide(rules, name, [e.shape for e in entries], label)
    splits[name] = split
    if split.kind == "replicated":
        _check_replica_shapes(entries, split, label)
        return _with_tp(e0, list(e0.pieces), e0.shape, None, tp)
    local = tuple(e0.shape)
    dim = split.dim if split.dim is not None else 0
    if dim >= len(local):
        raise UnsupportedError(
            f"tensor-parallel rule {quote(split.rule)} splits dimension {dim} of {quote(name)}, "
            f"whose slices have shape {list(local)}; {HOW_TO}"
        )
    shapes = [tuple(e.shape) for e in entries]
    if len(set(shapes)) != 1:  # uneven: joined in rank order, each slice's length as on disk
        geometry = for_uneven_slices(split, shapes, dim, tp, e0.key, label)
    else:
        geometry = for_slices(split, local, dim, tp, e0.key)
    return _with_tp(e0, geometry.join(entries), geometry.full_shape(local), dim, tp, split, geometry.shares)


def _check_replica_shapes(entries: list[TensorEntry], split: TpSplit, label: str) -> None:
    """A replicated tensor is whole on every rank: slices of another shape mean the rule is wrong
    for it (reading rank 0's would drop the others' without a word)."""
    e0 = entries[0]
    if all(tuple(e.shape) == tuple(e0.shape) for e in entries):
        return
    per_rank = ", ".join(f"rank {r}: {list(e.shape)}" for r, e in enumerate(entries))
    raise UnsupportedError(
        f"{label}: {e0.key} is declared replicated by tensor-parallel rule {quote(split.rule)}, "
        f"but its model-parallel slices differ in shape ({per_rank}); a replicated tensor is "
        f"whole on every rank, so the rule does not fit it; {HOW_TO}"
    )


def _user_replicated(rules: TpRules) -> set[int]:
    """ids of the "replicated" splits of the user's rules (--tp-rules FILE), the built-in ones left
    out: only those copies are compared when the checkpoint is read (verify --deep checks all)."""
    return {id(r.split) for r in rules.rules if r.split.kind == "replicated" and not r.source.startswith("built-in ")}


def _check_declared_replicas(
    source: Source,
    index: CheckpointIndex,
    keys: list[tuple[str, TpSplit]],
    replicas: dict[str, list[tuple[int, TensorEntry]]],
    label: str,
) -> None:
    """Every copy of a tensor the user's rule declared replicated holds rank 0's bytes: a rule that
    names a split tensor (equal slices of different values) is refused by name, not joined as
    rank 0's slice. Reads those tensors on every rank, in slabs."""
    if not keys:
        return
    fetcher = Fetcher(source, index=index)
    for key, split in keys:
        e0 = index.tensors[key]
        for rank, copy in replicas[key]:
            if not _same_bytes(fetcher, e0, copy):
                raise FormatError(
                    f"{label}: {key} is declared replicated by tensor-parallel rule "
                    f"{quote(split.rule)}, but model-parallel rank {rank}'s copy differs from rank "
                    f"0's; replicated tensors (layernorms) are equal on every rank, so the rule "
                    f"does not fit it: give its split instead (see docs/tp_rules.md)"
                )


def _same_bytes(fetcher: Fetcher, a: TensorEntry, b: TensorEntry) -> bool:
    """Whether two entries of one dtype and shape hold the same bytes, compared a slab at a time."""
    total = math.prod(a.shape)
    step = max(1, COMPARE_ELEMENTS_BYTES // itemsize(a.dtype))
    for start in range(0, total, step):
        length = min(step, total - start)
        if _slab_bytes(fetcher, a, start, length) != _slab_bytes(fetcher, b, start, length):
            return False
    return True


def _slab_bytes(fetcher: Fetcher, entry: TensorEntry, start: int, length: int) -> bytes:
    """Elements [start, start+length) of the entry's flattening as bytes (through torch only when
    they are not stored plainly)."""
    ranges = fetcher.byte_ranges(entry, start, length)
    if ranges is not None:
        return kernel_copy.read(fetcher.source, ranges)
    from ...lazy_torch import torch

    flat = fetcher.fetch(entry).reshape(-1)[start : start + length].contiguous()
    return flat.view(torch.uint8).numpy().tobytes()


def _decide(rules: TpRules, name: str, shapes: list[tuple[int, ...]], label: str) -> TpSplit:
    split = rules.find(name)
    if split is None:
        per_rank = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(shapes))
        raise UnsupportedError(
            f"{label}: tensor-parallel checkpoint: no split rule decides {quote(name)} (its "
            f"slices: {per_rank}), and the checkpoint records none; {HOW_TO}"
        )
    return split


def _with_tp(
    e0: TensorEntry,
    pieces: list[Piece],
    shape: tuple[int, ...],
    dim: int | None,
    tp: int,
    split: TpSplit | None = None,
    shares: tuple[tuple[int, ...], ...] | None = None,
) -> TensorEntry:
    tp_attr: dict[str, Any] = {"dim": dim, "size": tp}
    if split is not None and split.kind == "fused":
        tp_attr["fused"] = split.blocks
    if shares is not None:  # an uneven split: each rank's length along dim
        tp_attr["sizes"] = list(shares[0])
    return TensorEntry(
        e0.key,
        e0.dtype,
        tuple(shape),
        pieces,
        path=e0.path,
        attrs={**e0.attrs, "parallel": {**e0.attrs.get("parallel", {}), "tp": tp_attr}},
    )
