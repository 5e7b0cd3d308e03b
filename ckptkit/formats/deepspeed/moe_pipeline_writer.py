"""Write a mixture-of-experts PipelineModule checkpoint (moe_pipeline.py) at a new expert-parallel
and data-parallel size, the stages kept: `reshard --to pp=P,ep=E,dp=W` with P the source's
(`--to N` keeps pp and ep, dp = N / P).

DeepSpeed 0.19 saves each stage s as a MoE checkpoint under model-parallel rank s, and its MoE
groups are built inside each stage (groups._create_expert_and_data_parallel with the pipeline's
stride): in stage s, dp rank d is expert-parallel rank d % E. So each stage is written as
moe_writer.py writes a MoE checkpoint (its dense groups over W ranks, its expert groups over W/E),
the files named with mp rank s; the stage's expert files are copied byte for byte (they do not
change with ep or dp). Moving layers to other stages is not supported: MoE layer ids are counted
per stage in the expert files' names.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ...context import RunContext
from ...errors import UnsupportedError, UsageError, quote
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from .files import optim_file_name
from .group_plan import StatePlanner
from .moe_pipeline import PipelineMoeInfo, is_pipeline_moe
from .moe_writer import MoeTarget, _files as moe_files
from .tag_writer import keep_parallel_sizes, tag_name, write_tag, zero_config

__all__ = ["is_pipeline_moe", "write_pipeline_moe_zero"]


def target_sizes(index: CheckpointIndex, to: int | ParallelSizes) -> ParallelSizes:
    """(P, E, W) from `--to`: P must be the source's; E must divide W and every layer's expert count."""
    info: PipelineMoeInfo = index.native
    meta = index.metadata["deepspeed_moe"]
    sizes = keep_parallel_sizes(index, to, ParallelSizes(pp=info.pp, ep=int(meta["ep_size"])), resizable=("ep",),
                                kind="mixture-of-experts PipelineModule")
    if sizes.dp % sizes.ep:
        raise UsageError(f"--to {sizes}: the expert-parallel size must divide the data-parallel size (each "
                         f"expert-data-parallel group holds dp/ep ranks of a stage)")
    odd = {prefix: n for prefix, n in meta["num_experts"].items() if n % sizes.ep}
    if odd:
        prefix, n = next(iter(odd.items()))
        raise UsageError(f"--to {sizes}: MoE layer {quote(prefix)} has {n} experts, which {sizes.ep} expert-parallel "
                         f"ranks cannot share equally (ep must divide every layer's expert count)")
    return sizes


def write_pipeline_moe_zero(out: Output, index: CheckpointIndex, source: Source, to: int | ParallelSizes, *,
                            ctx: RunContext) -> list[str]:
    """Each stage laid out by the MoE writer at E and W, under its mp rank (module docstring)."""
    info: PipelineMoeInfo = index.native
    sizes = target_sizes(index, to)
    if sizes.tp != 1:
        raise UnsupportedError(f"--to {sizes}: adding tensor parallelism to the mixture-of-experts PipelineModule "
                               f"checkpoint {index.root} is not supported yet")
    zero_cfg = zero_config(index)
    tag = tag_name(info.ranks[0].files.tag, index)
    fetcher = Fetcher(source, index=index)
    files: dict[str, tuple[Any, Fetcher]] = {}
    copied: list[tuple[str, str]] = []
    for stage in range(info.pp):
        zinfo = info.ranks[stage]
        moe = {**index.metadata["deepspeed_moe"], "num_experts": info.num_experts[stage]}
        stage_index = dataclasses.replace(index, metadata={**index.metadata, "deepspeed_moe": moe})
        for name, structure in moe_files(stage_index, zinfo, MoeTarget(ep=sizes.ep, world=sizes.dp), tag, zero_cfg,
                                         StatePlanner(stage_index, fetcher)).items():
            base = name.rsplit("/", 1)[1]
            if base == "mp_rank_00_model_states.pt":
                files[f"{tag}/mp_rank_{stage:02d}_model_states.pt"] = (structure, fetcher)
            else:
                d = int(base.split("zero_pp_rank_", 1)[1].split("_", 1)[0])
                files[f"{tag}/{optim_file_name(d, zinfo.files.bf16_prefix, mp_rank=stage)}"] = (structure, fetcher)
        copied += [(zinfo.files.prefix + n, f"{tag}/{n}") for n in sorted(zinfo.files.expert_files)]
    return write_tag(out, source, tag, files, ctx, copied=copied, scripts=info.ranks[0].files.tag is not None)
