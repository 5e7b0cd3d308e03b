"""What no DeepSpeed writer lays out yet, refused in one sentence by asking the checkpoint's layout.

`convert --to zero*` and the world-size writer (a ZeRO checkpoint rewritten at a new dp size)
lay out plain ZeRO checkpoints only; the model-parallel families are written at new sizes by
`reshard --to tp=..,pp=..,ep=..,dp=..` (resharding.py). Each refusal asks `DeepSpeedLayout`
(layout.py), never the reader's record types.
"""

from __future__ import annotations

from ...errors import UnsupportedError
from ...index.types import CheckpointIndex
from .layout import MP_RANK_STAGES, DeepSpeedLayout

TENSOR_PARALLEL = (
    "converting a tensor-parallel DeepSpeed checkpoint to ZeRO is not supported yet (reshard "
    "--to tp=...,dp=... lays it out at new sizes)"
)
PIPELINE = (
    "converting a DeepSpeed pipeline-parallel checkpoint to ZeRO is not supported yet; reshard it "
    "with --to pp=...,dp=..., or convert it --to torch, dcp or fsdp2"
)
PIPELINE_TP = (
    "converting a pipeline x tensor-parallel DeepSpeed checkpoint to ZeRO is not supported yet; "
    "reshard it with --to tp=...,pp=...,dp=..."
)
MOE = (
    "converting a mixture-of-experts DeepSpeed checkpoint to ZeRO is not supported yet (reshard "
    "--to ep=...,dp=... rewrites it at new sizes)"
)
PIPELINE_MOE = "resharding a mixture-of-experts PipelineModule checkpoint is not supported yet"


def refuse_pipeline_reshard(where: str, index: CheckpointIndex) -> None:
    """convert --to zero*: a pipeline source (alone or with tp) is written by reshard --to pp=...,dp=... only."""
    layout = DeepSpeedLayout.of(index)
    if layout.family == "pipeline":
        raise UnsupportedError(f"{where}: {PIPELINE} (pipeline size {layout.pp})")
    if layout.family == "pipeline_tp":
        raise UnsupportedError(f"{where}: {PIPELINE_TP} (pp {layout.pp}, tp {layout.tp})")


def refuse_tensor_parallel(index: CheckpointIndex) -> None:
    """The world-size writer of one ZeRO checkpoint: per-mp-rank layouts are laid out by reshard --to tp=..."""
    layout = DeepSpeedLayout.of(index)
    if layout.tp > 1:
        raise UnsupportedError(
            f"{index.root}: {TENSOR_PARALLEL} (tensor-parallel size {layout.tp}); consolidate or "
            f"convert it to torch, safetensors or DCP instead"
        )


def refuse_pipeline_moe(index: CheckpointIndex) -> None:
    """The MoE writer at a world size: a MoE PipelineModule's stages are laid out by reshard --to pp=..."""
    layout = DeepSpeedLayout.of(index)
    if layout.stages == MP_RANK_STAGES:
        raise UnsupportedError(
            f"{index.root}: {PIPELINE_MOE} ({layout.pp} pipeline stages); consolidate "
            f"it or convert it to torch, safetensors or DCP instead"
        )


def refuse_experts(index: CheckpointIndex) -> None:
    """convert --to zero* (asked of every source, of any format): expert groups from a canonical
    state are not laid out yet (reshard writes them from the source's own files: split_ep.py)."""
    if "deepspeed_moe" in index.metadata:
        ep = index.metadata["deepspeed_moe"]["ep_size"]
        raise UnsupportedError(
            f"{index.root}: {MOE} (expert-parallel size {ep}); consolidate it or "
            f"convert it to torch, safetensors or DCP instead"
        )
