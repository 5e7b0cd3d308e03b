"""Write a native 3-D DeepSpeed checkpoint (pipeline x tensor x data parallel) for new sizes
(`reshard --to tp=T,pp=P,dp=W`; `--to N` keeps the source's tp and pp).

The reader (read.py, join_tp.py) joins the source into full tensors with each parameter's tp split.
Here tp_geometry's TpSlicer gives new tp rank t's slice of every tensor (a rank index of virtual
tensors over the full ones), and pipeline_writer lays rank t's slices out as a pipeline of P
stages (the layers assigned by --partition-method, computed on rank t's local parameter counts as
PipelineModule does on that rank), each stage one ZeRO-1 checkpoint over W data-parallel ranks.
Files, as DeepSpeed 0.19's PipelineEngine on PipeModelDataParallelTopology names them:
  layer_file(XX, TT)                    layer XX's state dict on tp rank TT (its slices)
  model_file(SS)                        SS = stage * T + tp rank; mp_world_size P * T,
                                        checkpoint_parallel_dimensions {pp_degree P, tp_degree T}
  optim_file(D, mp=SS)   partition D of W of that (stage, tp rank)'s groups
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

from ...context import RunContext
from ...errors import UnsupportedError, UsageError
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from ..torch_save.archive_writer import LazyTensor
from . import pipeline_writer as ppw
from .layout import DeepSpeedLayout
from .names import layer_file
from .group_plan import StatePlanner
from .info import ZeroInfo
from .pipeline_partition import chosen_layer_types, chosen_partition_method
from .native import DeepSpeedNative
from .templates import template_of
from .tag_writer import alignment, tag_name, write_tag, zero_config
from .autotp_cut import TpCut
from .tp_geometry import TpSlicer
from .writer import cell_files


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target3d:
    tp: int
    pp: int
    dp: int


def target_sizes(index: CheckpointIndex, to: int | ParallelSizes) -> Target3d:
    """(T, P, W) from `--to`: tp=T,pp=P,dp=W, or a world size N that keeps the source's tp and pp."""
    sizes = DeepSpeedLayout.of(index).resized(to, index.root)
    return Target3d(tp=sizes.tp, pp=sizes.pp, dp=sizes.dp)


def write_3d_zero(
    out: Output,
    index: CheckpointIndex,
    source: Source,
    to: int | ParallelSizes,
    *,
    ctx: RunContext,
    partition_method: str | None = None,
) -> list[str]:
    """Reshard a 3-D ZeRO-1 checkpoint to T x P x W ranks (module docstring)."""
    info: DeepSpeedNative = index.native
    target = target_sizes(index, to)
    method = partition_method or chosen_partition_method()
    pinfo = info.pipelines[0]
    zinfo: ZeroInfo = pinfo.stages[min(pinfo.stages)]
    if "zero_stage" not in (zinfo.optim_states[min(zinfo.optim_states)].get("optimizer_state_dict") or {}):
        raise UnsupportedError(
            f"{index.root}: a 3-D checkpoint written by BF16_Optimizer is not laid out at new "
            f"sizes yet (ZeRO stage 1 is)"
        )
    align = alignment(zero_config(index), zinfo.dtype)
    slicer = TpSlicer(index, info.splits, target.tp, TpCut(index, source, target.tp))
    tag = tag_name(zinfo.files.tag, index)
    m0, marchive = template_of(zinfo, "model", min(zinfo.files.model_files))
    files: dict[str, tuple[Any, Fetcher]] = {}
    for t in range(target.tp):
        rank_index = slicer.rank_index(t, target.dp)
        rank_index.native = _local_pipeline(pinfo, rank_index)
        layers, stage_of = ppw.layer_table(rank_index)
        if target.pp > max(len(layers), len(chosen_layer_types() or ())):
            raise UsageError(
                f"--to pp={target.pp}: {index.root} has {len(layers)} layers, fewer than the "
                f"{target.pp} pipeline stages asked for"
            )
        layers, parts = ppw.new_stages(rank_index, layers, stage_of, method, target.pp, chosen_layer_types())
        plans = ppw.stage_plans(rank_index, layers, parts, align)
        fetcher = Fetcher(source, index=rank_index)
        states = StatePlanner(rank_index, fetcher)
        for plan in plans:
            ppw.check_trainable(plan, target.pp)
            cell = ppw.stage_cell(
                zinfo,
                plan,
                plan.stage * target.tp + t,
                lambda plan=plan: _stage_model(m0, marchive, plan, target),
                lambda g, stage=plan.stage, t=t: f"group {g.index} of stage {stage}, tp rank {t}",
            )
            structures = cell_files(rank_index, ppw.stage_info(zinfo, plan), target.dp, tag, None, states, cell)
            files.update((name, (structure, fetcher)) for name, structure in structures.items())
        for layer, rel in sorted(pinfo.layer_files.items()):
            files[f"{tag}/{layer_file(layer, t)}"] = (
                _layer_state(index, pinfo, rank_index, layer),
                fetcher,
            )
    return write_tag(out, source, tag, files, ctx, scripts=zinfo.files.tag is not None)


def _stage_model(m0: dict, marchive: Any, plan: Any, target: Target3d) -> dict:
    """A (stage, tp rank)'s model-states file: the pipeline writer's, with the 3-D sizes."""
    model = ppw.stage_model(m0, marchive, plan, ppw.PpTarget(pp=target.pp, dp=target.dp))
    model["mp_world_size"] = target.pp * target.tp
    if isinstance(model.get("checkpoint_parallel_dimensions"), dict):
        model["checkpoint_parallel_dimensions"] = {
            **model["checkpoint_parallel_dimensions"],
            "pp_degree": target.pp,
            "tp_degree": target.tp,
        }
    return model


def _local_pipeline(pinfo: Any, rank_index: CheckpointIndex) -> Any:
    """tp rank 0's pipeline (DeepSpeedNative.lane) with each stage's groups at the new rank's slice shapes."""

    def local(z: ZeroInfo) -> ZeroInfo:
        groups = [
            dataclasses.replace(
                g, params=tuple((n, tuple(rank_index.tensors[f"model.{n}"].shape)) for n, _ in g.params)
            )
            for g in z.groups
        ]
        return dataclasses.replace(z, groups=groups)

    return dataclasses.replace(pinfo, cells={c: local(z) for c, z in pinfo.cells.items()})


def _layer_state(index: CheckpointIndex, pinfo: Any, rank_index: CheckpointIndex, layer: int) -> OrderedDict:
    """Layer `layer`'s state dict on the new tp rank: its low-precision weights' slices
    (ds_module.<name>) and buffers (model.<name>), in the source layer file's order (the index
    keeps the order the reader met them in the file)."""
    prefix = f"tied_modules.{pinfo.tied_layers[layer]}." if layer in pinfo.tied_layers else f"{layer}."
    state = OrderedDict()
    for key, e in index.tensors.items():
        if key.startswith("ds_module." + prefix):
            state[key[len("ds_module." + prefix) :]] = LazyTensor(rank_index.tensors[key])
        elif key.startswith("model." + prefix) and e.attrs.get("ds_role") == "buffer":
            state[key[len("model." + prefix) :]] = LazyTensor(rank_index.tensors[key])
    return state
