"""The writer's ep split: how each cell's expert groups are partitioned, the identity without experts.

The reader joins experts inside each cell as it reads it (moe.py), or across the tp ranks when
they are whole (join_ep.py); the writer splits them last, in each (stage, tp rank) cell: its dense
groups over the cell's dp ranks, each expert group over the ranks of one expert-parallel rank
(writer.ExpertSplit). A cell without experts is a plain ZeRO cell: the stage's model file (or the
source's) with the lane's slices and sizes.
"""

from __future__ import annotations

from ...index.parallel_spec import ParallelSizes
from .split_pp import Stage
from .split_tp import Lane
from .writer import Cell, stage12_model


def cell(lane: Lane, stage: Stage, sizes: ParallelSizes) -> Cell:
    """The ZeRO cell (writer.cell_files) of one (stage, tp rank): what its files add to a plain one's."""
    base = stage.model
    if base is None and lane.target is None:
        model12 = None
    elif base is None:
        model12 = lambda info, groups, world: lane.finish_model(stage12_model(info, groups, world))  # noqa: E731
    else:
        model12 = lambda info, groups, world: lane.finish_model(base())  # noqa: E731
    return Cell(
        mp=stage.mp,
        stage12_model=model12,
        stage3_model=None if lane.target is None else lane.finish_stage3_model,
        label=stage.label,
        finish_optim=stage.finish_optim,
    )
