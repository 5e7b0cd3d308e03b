"""The writer's pp split: a lane's new pipeline stages, the identity at pp 1.

The reader joins each tp rank's stages into its pipeline (join_pp.py); the writer cuts a lane
(split_tp.py) into its new stages, each one ZeRO cell under model-parallel rank stage x tp + tp
rank. Stages come in the two variants the reader joins: a PipelineModule's layer-file stages
(pipeline_stages.py: layers assigned by `--partition-method` as PipelineModule does, each stage
one ZeRO-1 checkpoint over its own parameters) and a MoE PipelineModule's mp-rank stages
(moe_stages.py: each a MoE checkpoint of the layers it holds). Without stages the lane is one
cell: its own ZeRO record.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from .info import ZeroGroup, ZeroInfo
from .layout import NO_STAGES, DeepSpeedLayout
from .split_tp import Lane


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One (stage, tp rank) cell of the new layout: its model-parallel rank, the index and ZeRO
    record it is written from, and what a pipeline stage changes in its files (None: the lane's)."""

    mp: int
    index: CheckpointIndex
    info: ZeroInfo
    label: Callable[[ZeroGroup], str] | None = None  # a group in messages
    model: Callable[[], dict] | None = None  # a pipeline stage's stage 1/2 model-states file
    finish_optim: Callable | None = None  # what a pipeline stage adds to each optim file (writer.Cell)


def stages(index: CheckpointIndex, lane: Lane, sizes: ParallelSizes) -> Iterator[Stage]:
    """The lane's new stages (module docstring); one, the lane itself, without pipeline stages."""
    layout = DeepSpeedLayout.of(index)
    if layout.stages == NO_STAGES:
        t = lane.rank
        label = None if lane.target is None else (lambda g: f"group {g.index} of mp rank {t}")
        yield Stage(mp=t, index=lane.index, info=lane.info, label=label)
        return
    raise NotImplementedError(layout.stages)
