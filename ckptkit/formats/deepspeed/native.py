"""`DeepSpeedNative`: what the reader keeps of every DeepSpeed checkpoint beyond its index.

One type, whatever the parallel layout: the layout (layout.py: sizes, ZeRO stage, naming variants),
the ZeRO record (`ZeroInfo`) of each (pipeline stage, tp rank) cell, and what the joins over ep,
pp and tp found (the tp splits and the copies of replicated tensors; a PipelineModule's layer
files and tied modules; a MoE PipelineModule's experts per stage). The writers, verify and
convert read it; the per-combination views the writers lay a checkpoint out with (`ranks`,
`stages`, `pipelines`) are its properties.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...convert.tp_rules import TpSplit
from ...errors import FormatError
from ...index.types import CheckpointIndex, TensorEntry
from .info import ZeroInfo
from .layout import LAYER_FILES, MP_RANK_STAGES, NO_EXPERTS, NO_STAGES, SLICED_EXPERTS, WHOLE_EXPERTS, DeepSpeedLayout
from .names import parse_layer_file

Copies = dict[str, list[tuple[int, TensorEntry]]]  # key -> (rank or stage, that copy's entry)


@dataclass(frozen=True, kw_only=True)
class PipelineLane:
    """One tp rank's PipelineModule facts: its layer files and tied modules (layer-file stages)."""

    layers: dict[int, int] = field(default_factory=dict)  # layer index -> stage
    layer_files: dict[int, str] = field(default_factory=dict)  # layer index -> its file (source-relative)
    tied_layers: dict[int, str] = field(default_factory=dict)  # layer index -> tied key its file holds
    tied_copies: Copies = field(default_factory=dict)  # a tied module's copies on later stages


@dataclass(frozen=True, kw_only=True)
class DeepSpeedNative:
    """index.native of every DeepSpeed checkpoint the reader builds."""

    layout: DeepSpeedLayout
    cells: dict[tuple[int, int], ZeroInfo]  # (stage, tp rank) -> that cell's ZeRO record
    splits: dict[str, TpSplit] = field(default_factory=dict)  # parameter -> its split (the tp join)
    tp_copies: Copies = field(default_factory=dict)  # a tp-replicated tensor's copies on tp ranks 1..
    lanes: dict[int, PipelineLane] = field(default_factory=dict)  # tp rank -> its pipeline's layer files
    stage_experts: dict[int, dict[str, int]] = field(default_factory=dict)  # mp-rank stage -> its MoE layers

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    def cell(self, stage: int = 0, tp_rank: int = 0) -> ZeroInfo:
        """The ZeRO record of one (stage, tp rank) cell; (0, 0), a plain checkpoint's one."""
        return self.cells[(stage, tp_rank)]

    @property
    def ranks(self) -> dict[int, ZeroInfo]:
        """mp rank -> ZeroInfo: every cell under DeepSpeed's model-parallel rank (stage x tp + tp rank)."""
        return {self.layout.mp_rank(s, t): z for (s, t), z in sorted(self.cells.items())}

    @property
    def stages(self) -> dict[int, ZeroInfo]:
        """stage -> ZeroInfo of tp rank 0's cells."""
        return {s: z for (s, t), z in sorted(self.cells.items()) if t == 0}

    def lane(self, tp_rank: int) -> "DeepSpeedNative":
        """tp rank `tp_rank`'s pipeline alone, as a record of its own (tp 1)."""
        return dataclasses.replace(
            self,
            layout=dataclasses.replace(self.layout, tp=1),
            cells={(s, 0): z for (s, t), z in self.cells.items() if t == tp_rank},
            splits={},
            tp_copies={},
            lanes={0: self.lanes[tp_rank]} if tp_rank in self.lanes else {},
        )

    @property
    def pipelines(self) -> dict[int, "DeepSpeedNative"]:
        """tp rank -> its pipeline (`lane`)."""
        return {t: self.lane(t) for t in sorted(self.lanes)}

    @property
    def layers(self) -> dict[int, int]:
        return self.lanes[0].layers if 0 in self.lanes else {}

    @property
    def layer_files(self) -> dict[int, str]:
        return self.lanes[0].layer_files if 0 in self.lanes else {}

    @property
    def tied_layers(self) -> dict[int, str]:
        return self.lanes[0].tied_layers if 0 in self.lanes else {}

    @property
    def num_experts(self) -> dict[int, dict[str, int]]:
        """mp-rank stage -> its MoE layers' expert counts (a MoE PipelineModule)."""
        return self.stage_experts

    def replica_entries(self) -> dict[str, list[tuple[str, TensorEntry]]]:
        """key -> [(what, entry)]: the other copies that must hold the same bytes (verify --deep):
        the tp ranks' copies of replicated tensors, then tp rank 0's tied-module copies."""
        rank = "tensor-parallel rank" if self.lanes else "model-parallel rank"
        out = {key: [(f"{rank} {r}'s copy", e) for r, e in copies] for key, copies in self.tp_copies.items()}
        if 0 in self.lanes:
            for key, copies in self.lanes[0].tied_copies.items():
                out.setdefault(key, []).extend((f"pipeline stage {s}'s copy", e) for s, e in copies)
        return out


def native_of(index: CheckpointIndex) -> DeepSpeedNative:
    """The DeepSpeed record of an index the reader built; refused for any other."""
    native = index.native
    if not isinstance(native, DeepSpeedNative):
        raise FormatError(f"{index.root}: is not a DeepSpeed checkpoint read by ckptkit")
    return native


def layout_read(
    index: CheckpointIndex,
    cells: dict[tuple[int, int], ZeroInfo],
    lanes: dict[int, PipelineLane] | None = None,
    *,
    mp_rank_stages: bool = False,
) -> DeepSpeedLayout:
    """The layout of a joined index: its sizes from the cells, its variants from the metadata the
    joins wrote (`deepspeed_moe`, `deepspeed.stage`) and the layer files' names."""
    first = cells[min(cells)]
    moe: Any = index.metadata.get("deepspeed_moe")
    moe = moe if isinstance(moe, dict) else None
    experts = NO_EXPERTS if moe is None else WHOLE_EXPERTS if moe.get("experts") == "whole" else SLICED_EXPERTS
    layer_names = [n.rsplit("/", 1)[-1] for lane in (lanes or {}).values() for n in lane.layer_files.values()]
    stages = LAYER_FILES if lanes else MP_RANK_STAGES if mp_rank_stages else NO_STAGES
    meta = index.metadata.get("deepspeed", {})
    return DeepSpeedLayout(
        tp=1 + max(t for _, t in cells),
        pp=1 + max(s for s, _ in cells),
        ep=int(moe["ep_size"]) if moe is not None else 1,
        dp=first.world_size,
        zero_stage=int(meta.get("stage", first.stage)) if isinstance(meta, dict) else first.stage,
        stages=stages,
        experts=experts,
        bf16_prefix=bool(first.files.bf16_prefix),
        megatron_layer_names=any((parse_layer_file(n) or (0, None))[1] is not None for n in layer_names),
        num_experts=tuple(dict(moe["num_experts"]).items()) if moe is not None else (),
    )
