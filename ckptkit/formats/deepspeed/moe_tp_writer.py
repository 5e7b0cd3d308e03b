"""Write a DeepSpeed mixture-of-experts checkpoint with tensor parallelism (a Megatron-style mpu,
`MoE(..., enable_expert_tensor_parallelism=True)`, ZeRO 1/2) at new sizes: `reshard --to
tp=T,ep=E,dp=W` (`--to N` keeps tp and ep).

DeepSpeed 0.19 lays such a checkpoint out as T MoE checkpoints side by side, one per mp rank t
(groups._create_expert_data_and_model_parallel: inside each tp lane, dp rank d is expert-parallel
rank d % E and expert-data-parallel rank d // E):
  model_file(t)                                   rank t's dense module slices, param_shapes
                                                  (ep rank 0's local experts), mp_world_size T,
                                                  dp_world_size W
  expert_file(L, G, t)
                                                  rank t's slice of expert G's weights
  optim_file(d, bf16, mp=t)
                                                  dp rank d's partition of rank t's dense groups
                                                  and of its expert groups (moe_writer.py's cell)
So each new mp rank t is one ZeRO cell (writer.cell_files) with moe_writer.moe_cell's expert
split, from a *rank index* (tp_geometry.TpSlicer: rank t's slice of every full tensor, as REF
ranges of it) and templates with rank t's slice shapes. At the source's tp the expert files are
copied byte for byte (they do not change with ep or dp); at a new tp each is written from rank t's
slices.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable, Iterator

from ...context import RunContext
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from ...torch_types import Size
from ..torch_save.archive_writer import LazyTensor
from .layout import DeepSpeedLayout
from .names import expert_file
from .group_plan import StatePlanner
from .info import ZeroInfo
from .native import DeepSpeedNative
from .moe import MARK
from .split_ep import moe_cell
from .tag_writer import alignment, tag_name, write_tag, zero_config
from .autotp_cut import TpCut
from .tp_geometry import TpSlicer
from .split_tp import TpTarget, local_group, module_slices, record_tp_sizes
from .writer import cell_files


def target_sizes(index: CheckpointIndex, to: int | ParallelSizes) -> ParallelSizes:
    """(T, E, W) from `--to`, E checked against dp and every MoE layer's expert count."""
    return DeepSpeedLayout.of(index).resized(to, index.root)


def write_moe_tp_zero(
    out: Output, index: CheckpointIndex, source: Source, to: int | ParallelSizes, *, ctx: RunContext
) -> list[str]:
    """Reshard a MoE + TP ZeRO-1/2 checkpoint to T mp ranks of W dp ranks, E expert-parallel (module docstring)."""
    info: DeepSpeedNative = index.native
    sizes = target_sizes(index, to)
    meta = index.metadata["deepspeed_moe"]
    zinfo0: ZeroInfo = info.ranks[0]
    zero_cfg = zero_config(index)
    tag = tag_name(zinfo0.files.tag, index)
    files: dict[str, tuple[Any, Fetcher]] = {}
    copied: list[tuple[str, str]] = []
    for t, rank_index, fetcher, zinfo in tp_lanes(index, source, sizes):
        cell = moe_cell(
            rank_index, zinfo, zero_cfg, ep=sizes.ep, world=sizes.dp, mp=t, finish_model=lane_model(rank_index, sizes)
        )
        for name, structure in cell_files(
            rank_index, zinfo, sizes.dp, tag, None, StatePlanner(rank_index, fetcher), cell
        ).items():
            files[name] = (structure, fetcher)
        if sizes.tp == info.tp:
            copied += [(zinfo.files.prefix + n, f"{tag}/{n}") for n in sorted(zinfo.files.expert_files)]
        else:
            for name, structure in _expert_files(rank_index, dict(meta["num_experts"]), t).items():
                files[f"{tag}/{name}"] = (structure, fetcher)
    return write_tag(out, source, tag, files, ctx, copied=copied, scripts=zinfo0.files.tag is not None)


def tp_lanes(
    index: CheckpointIndex, source: Source, sizes: ParallelSizes
) -> Iterator[tuple[int, CheckpointIndex, Fetcher, ZeroInfo]]:
    """Each new mp rank t of a MoE + TP checkpoint: (t, its rank index, a fetcher over it, its
    templates with its slice shapes), as both MoE + TP writers lay a lane out with moe_writer.moe_cell."""
    info: DeepSpeedNative = index.native
    zinfo0: ZeroInfo = info.ranks[0]
    align = alignment(zero_config(index), zinfo0.dtype)
    slicer = TpSlicer(index, info.splits, sizes.tp, TpCut(index, source, sizes.tp))
    for t in range(sizes.tp):
        rank_index = slicer.rank_index(t, sizes.dp)
        rank_index.metadata["deepspeed_moe"] = index.metadata["deepspeed_moe"]
        zinfo = _rank_templates(info.ranks[t] if sizes.tp == info.tp else zinfo0, rank_index, align)
        yield t, rank_index, Fetcher(source, index=rank_index), zinfo


def lane_model(rank_index: CheckpointIndex, sizes: ParallelSizes) -> Callable[[dict], dict]:
    """What a tp lane's model-states file changes: its module slices and the new sizes."""
    return lambda model: record_tp_sizes(module_slices(model, rank_index), TpTarget(tp=sizes.tp, dp=sizes.dp))


def _rank_templates(zinfo: ZeroInfo, rank_index: CheckpointIndex, align: int) -> ZeroInfo:
    """The mp rank's templates with its new slice shapes: groups and the model file's param_shapes."""
    groups = [local_group(g, rank_index, align) for g in zinfo.groups]
    first = min(zinfo.model_states)
    m0 = zinfo.model_states[first]
    # names of ep rank 0's local experts, whose local ids are their global ones
    param_shapes = [
        OrderedDict(
            (n, _shape_like(s, rank_index.tensors[f"model.{n}"].shape) if f"model.{n}" in rank_index.tensors else s)
            for n, s in g.items()
        )
        for g in m0["param_shapes"]
    ]
    return dataclasses.replace(
        zinfo, groups=groups, model_states={**zinfo.model_states, first: {**m0, "param_shapes": param_shapes}}
    )


def _shape_like(saved: Any, shape: tuple[int, ...]) -> Any:
    """`shape` as the saved value's type (DeepSpeed saves a tuple or a torch.Size): the same object
    when unchanged."""
    if tuple(saved) == tuple(shape):
        return saved
    return tuple(shape) if type(saved) is tuple else Size(shape)


def _expert_files(rank_index: CheckpointIndex, counts: dict[str, int], t: int) -> dict[str, Any]:
    """expert_file(L, G, t): expert G's weight slices under their global names."""
    out: dict[str, Any] = {}
    for layer, (prefix, count) in enumerate(counts.items()):
        for expert in range(count):
            head = f"ds_module.{prefix}{MARK}{expert}."
            out[expert_file(layer, expert, t)] = dict(  # as DeepSpeed saves it
                (key[len("ds_module.") :], LazyTensor(entry))
                for key, entry in rank_index.tensors.items()
                if key.startswith(head)
            )
    return out
