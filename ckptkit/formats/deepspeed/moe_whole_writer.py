"""Write a DeepSpeed MoE + TP checkpoint whose experts are whole (`MoE(...,
enable_expert_tensor_parallelism=False)` under an mpu, join_ep.py's layout) at new sizes:
`reshard --to tp=T,ep=E,dp=W` (`--to N` keeps tp and ep).

Target rank r = t + T*d (tp rank t, dp rank d, W dp ranks, T*W ranks in all) writes
  optim_file(d, mp=t)
      its dense groups: partition d of W of tp lane t's slices (as tp_writer / moe_tp_writer);
      its expert groups: partition r // E of T*W/E of ep rank r % E's local experts, whole
and dp rank 0 of lane t writes model_file(t) (lane t's module slices, param_shapes
naming E's local experts, mp_world_size T, dp_world_size W). Expert G (ep rank e) is saved by
global rank e, mp rank e % T: its file, the same bytes at any size, is copied under that name.

Each tp lane is one ZeRO cell (writer.cell_files) of the lane's slice index (moe_tp_writer's
tp_lanes: tp_geometry's slices and the lane's templates), with moe_writer.moe_cell's expert split
over all T*W ranks: lane t's dp rank d is global rank t + T*d (ExpertSplit's lane and stride).
"""

from __future__ import annotations

from typing import Any

from ...context import RunContext
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from .layout import DeepSpeedLayout
from .names import EXPERT_ID, expert_file
from .group_plan import StatePlanner
from .info import ZeroInfo
from .native import DeepSpeedNative
from .moe_tp_writer import lane_model, tp_lanes
from .split_ep import moe_cell
from .tag_writer import tag_name, write_tag, zero_config
from .writer import cell_files


def target_sizes(index: CheckpointIndex, to: int | ParallelSizes) -> ParallelSizes:
    """(T, E, W) from `--to`: E must divide the T*W ranks (DeepSpeed's expert groups are consecutive
    global ranks) and every MoE layer's expert count, and T must divide E (else DeepSpeed cannot load
    the experts: at tp 4, ep 2 rank 2 reads expert_file(0, 0, 2), which rank 0 never saves)."""
    return DeepSpeedLayout.of(index).resized(to, index.root)


def write_whole_experts(
    out: Output, index: CheckpointIndex, source: Source, to: int | ParallelSizes, *, ctx: RunContext
) -> list[str]:
    """Reshard a whole-expert MoE + TP ZeRO-1/2 checkpoint (module docstring)."""
    info: DeepSpeedNative = index.native
    sizes = target_sizes(index, to)
    zinfo0: ZeroInfo = info.ranks[0]
    zero_cfg = zero_config(index)
    tag = tag_name(zinfo0.files.tag, index)
    files: dict[str, tuple[Any, Fetcher]] = {}
    for t, rank_index, fetcher, zinfo in tp_lanes(index, source, sizes):
        cell = moe_cell(
            rank_index,
            zinfo,
            zero_cfg,
            ep=sizes.ep,
            world=sizes.dp,
            mp=t,
            lane=t,
            stride=sizes.tp,
            finish_model=lane_model(rank_index, sizes),
        )
        for name, structure in cell_files(
            rank_index, zinfo, sizes.dp, tag, None, StatePlanner(rank_index, fetcher), cell
        ).items():
            files[name] = (structure, fetcher)
    copied = _expert_copies(index, info, tag, sizes)
    return write_tag(out, source, tag, files, ctx, copied=copied, scripts=zinfo0.files.tag is not None)


def _expert_copies(
    index: CheckpointIndex, info: DeepSpeedNative, tag: str, sizes: ParallelSizes
) -> list[tuple[str, str]]:
    """(source file, output name) of every expert file: expert G of ep rank e under mp rank e % T."""
    counts = dict(index.metadata["deepspeed_moe"]["num_experts"])
    prefix = info.ranks[0].files.prefix
    found: dict[tuple[int, int], str] = {}
    for zinfo in info.ranks.values():
        for name in zinfo.files.expert_files:
            layer, expert = EXPERT_ID.match(name).groups()
            found[(int(layer or 0), int(expert))] = name
    copied = []
    for layer, n in enumerate(counts.values()):
        local = n // sizes.ep
        for expert in range(n):
            mp = (expert // local) % sizes.tp
            copied.append(
                (
                    prefix + found[(layer, expert)],
                    f"{tag}/{expert_file(layer, expert, mp)}",
                )
            )
    return copied
