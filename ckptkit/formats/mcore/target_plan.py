"""Decide what `reshard --to tp=T,pp=P[,ep=E][,dp=D]` writes for a Megatron-Core checkpoint, or
refuse it in one sentence before anything is written.

Refused: a `dp_reshardable` distributed optimizer asked to follow any layout change (its flat
per-bucket buffers follow MCore's grad-buffer layout of each tp/pp rank, which changes with tp, pp
and ep: MCore itself refuses that load; across dp only MCore regroups them itself, on load, which
ckptkit does not redo: load the source at the new dp); a mixture of experts (its expert layout is
not written yet); a layer count the pipeline does not split evenly (MCore's default split); an ep
that does not divide dp (MCore's expert-parallel ranks are data-parallel ranks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UnsupportedError
from ...index.types import CheckpointIndex
from .layout_target import McoreLayout, is_gated, mcore_layout, num_layers, param_of
from .names import role_of
from .writer import RNG_STATE, McoreTarget

if TYPE_CHECKING:
    from ...index.parallel_spec import ParallelSizes
    from ..opened import Opened

EXPERTS = "mlp.experts."
DP_RESHARDABLE_REFUSAL = (
    "{root}: its distributed optimizer was saved dp_reshardable (flat per-bucket buffers laid out for "
    "{source}), which ckptkit cannot lay out for {target}; resave it with "
    "--dist-ckpt-optim-fully-reshardable, or reshard the model alone with --model-only"
)


def source_sizes(index: CheckpointIndex) -> dict[str, int]:
    """The tp/pp/ep/dp sizes the source's args record (1 where they say nothing)."""
    parallel = index.metadata.get("parallel") or {}
    return {axis: int(parallel.get(axis) or 1) for axis in ("tp", "pp", "ep", "dp")}


def _sizes_text(sizes: dict[str, int]) -> str:
    return ",".join(f"{axis}={sizes[axis]}" for axis in ("tp", "pp", "ep", "dp"))


def model_view(index: CheckpointIndex) -> CheckpointIndex:
    """`index` without its optimizer state (--model-only)."""
    view = CheckpointIndex(format=index.format, root=index.root, world_size=index.world_size, step=index.step)
    view.files, view.metadata = dict(index.files), dict(index.metadata)
    view.tensors = {k: e for k, e in index.tensors.items() if role_of(k).kind == "model"}
    view.objects = {k: o for k, o in index.objects.items() if not k.startswith("optimizer")}
    return view


def plan(opened: "Opened", sizes: "ParallelSizes", model_only: bool = False) -> McoreTarget:
    """The writer's target for `sizes`, or an UnsupportedError saying why it cannot be written."""
    index = model_view(opened.index) if model_only else opened.index
    root = opened.path
    source = source_sizes(index)
    target = {"tp": sizes.tp, "pp": sizes.pp, "ep": sizes.ep, "dp": sizes.dp}
    flat = [k for k in index.tensors if role_of(k).kind == "flat_buffer"]
    if flat and any(source[a] != target[a] for a in ("tp", "pp", "ep", "dp")):
        raise UnsupportedError(
            DP_RESHARDABLE_REFUSAL.format(root=root, source=_sizes_text(source), target=_sizes_text(target))
        )
    if sizes.dp % sizes.ep:
        raise UnsupportedError(
            f"{root}: ep={sizes.ep} does not divide dp={sizes.dp}: MCore's expert-parallel ranks are "
            f"data-parallel ranks (give a dp that ep divides)"
        )
    experts = [k for k in index.tensors if EXPERTS in param_of(k)]
    if experts:
        raise UnsupportedError(
            f"{root}: {experts[0]} is a mixture-of-experts tensor; resharding MCore experts is not supported yet"
        )
    layers = num_layers(index) or 0
    if layers % sizes.pp:
        raise UnsupportedError(
            f"{root}: its {layers} decoder layers do not split evenly over pp={sizes.pp} (MCore's default "
            f"pipeline split); pick a pp that divides {layers}"
        )
    layout = McoreLayout(tp=sizes.tp, pp=sizes.pp, dp=sizes.dp, num_layers=layers, gated=is_gated(index))
    mcore_layout(index, layout, list(index.tensors), [], where=root)  # a split tp cannot make: refused now
    folder = index.metadata.get("iteration_folder")
    keep_rng = source["tp"] == sizes.tp and source["pp"] == sizes.pp
    return McoreTarget(index, opened.source, layout, folder, keep_rng, ep=sizes.ep, model_only=model_only)


def notes(target: McoreTarget, source: CheckpointIndex) -> list[str]:
    """What the summary says beside the counts: what was left out, and why."""
    out = []
    if target.model_only:
        left = len(source.tensors) - len(target.index.tensors)
        out.append(
            f"--model-only: {len(target.index.tensors)} model tensors written; {left} optimizer tensors and "
            f"common.pt's optimizer entry left out"
        )
    dropped = [k for k in target.index.objects if k.startswith(RNG_STATE)] if not target.keep_rng else []
    if dropped:
        out.append(
            f"not written: {len(dropped)} per-rank RNG states (rng_state) of the old tp/pp layout; "
            f"Megatron-LM ignores them at a new tp/pp too (load with --no-load-rng)"
        )
    return out
