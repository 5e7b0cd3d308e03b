"""The writer's tp split: each new tensor-parallel rank's lane, the identity at tp 1.

The reader joins the tp ranks' lanes into full tensors last (join_tp.py), so the writer splits
them first: tp_geometry's TpSlicer gives new tp rank t a *rank index* (its slice of every full
tensor as REF ranges of it, the full tensors under hidden keys), a fetcher over it, and the
source's ZeRO record with its slice shapes (groups, alignment paddings, the model file's
param_shapes). The pp and ep splits then cut the lane, and each of its cells is written as a ZeRO
checkpoint (writer.cell_files). A lane's model-states files hold its module slices and the new
sizes (`Lane.finish_model`); a pipeline lane also writes its layer files' slices
(`layer_states`). At tp 1 (a source and a target without tp) the lane is the source itself.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Iterator

from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from ...runner.fetch import Fetcher
from ...storage.source import Source
from ...torch_types import Size
from ..torch_save.archive_writer import LazyTensor
from .autotp_cut import TpCut
from .info import ZeroGroup, ZeroInfo
from .layout import LAYER_FILES, DeepSpeedLayout
from .names import layer_file
from .native import DeepSpeedNative, native_of
from .tag_writer import alignment, alignment_paddings, zero_config
from .tp_geometry import TpSlicer, affine_map_for


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpTarget:
    """The sizes a lane's model-states files record (mp_world_size is tp x pp)."""

    tp: int
    dp: int
    pp: int = 1
    shares: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # uneven cuts, by name


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lane:
    """One new tp rank: the index its cells read, the fetcher over it, the ZeRO record its cells
    are written from (`info`: the template cell with its slice shapes; `native`: the whole record,
    a pipeline's stages with their slice shapes), and the sizes its model files record (None: the
    identity lane, nothing changed)."""

    rank: int
    index: CheckpointIndex
    fetcher: Fetcher
    info: ZeroInfo
    native: DeepSpeedNative
    target: TpTarget | None = None

    def finish_model(self, model: dict) -> dict:
        """A stage 1/2 model-states file of this lane: its module slices and the new sizes."""
        return model if self.target is None else record_tp_sizes(module_slices(model, self.index), self.target)

    def finish_stage3_model(self, model: dict) -> dict:
        """A ZeRO-3 model-states file of this lane: the new sizes."""
        return model if self.target is None else record_tp_sizes(model, self.target)


def lanes(index: CheckpointIndex, source: Source, sizes: ParallelSizes) -> Iterator[Lane]:
    """Each new tp rank's lane (module docstring); one lane, the source itself, at tp 1."""
    layout, native = DeepSpeedLayout.of(index), native_of(index)
    if layout.tp == 1 and sizes.tp == 1:
        yield Lane(rank=0, index=index, fetcher=Fetcher(source, index=index), info=native.cell(), native=native)
        return
    zinfo0 = native.cell()
    align = alignment(zero_config(index), zinfo0.dtype)
    slicer = TpSlicer(index, native.splits, sizes.tp, TpCut(index, source, sizes.tp))
    target = TpTarget(tp=sizes.tp, pp=sizes.pp, dp=sizes.dp, shares=slicer.uneven_shares())
    for t in range(sizes.tp):
        rank_index = slicer.rank_index(t, sizes.dp)
        lane_native = native
        if layout.stages == LAYER_FILES:
            lane_native = local_pipeline(native.lane(0), rank_index)
            rank_index.native = lane_native
        if "deepspeed_moe" in index.metadata:
            rank_index.metadata["deepspeed_moe"] = index.metadata["deepspeed_moe"]
        own = native.cell(0, t) if sizes.tp == layout.tp else zinfo0
        yield Lane(
            rank=t,
            index=rank_index,
            fetcher=Fetcher(source, index=rank_index),
            info=rank_templates(own, rank_index, align),
            native=lane_native,
            target=target,
        )


def local_group(group: ZeroGroup, rank_index: CheckpointIndex, align: int) -> ZeroGroup:
    """The group with rank t's slice shapes (and DeepSpeed's alignment paddings for them)."""
    params = tuple((n, tuple(rank_index.tensors[f"model.{n}"].shape)) for n, _ in group.params)
    paddings = None
    if group.paddings is not None:
        paddings = tuple(alignment_paddings([s for _, s in params], align)) if align > 1 else group.paddings
    return dataclasses.replace(group, params=params, paddings=paddings)


def rank_templates(zinfo: ZeroInfo, rank_index: CheckpointIndex, align: int) -> ZeroInfo:
    """The mp rank's templates with its new slice shapes: groups and the model file's param_shapes
    (a MoE model's name ep rank 0's local experts, whose local ids are their global ones)."""
    groups = [local_group(g, rank_index, align) for g in zinfo.groups]
    first = min(zinfo.model_states)
    m0 = zinfo.model_states[first]
    if not isinstance(m0.get("param_shapes"), list):  # BF16_Optimizer saves None: left so
        return dataclasses.replace(zinfo, groups=groups)
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


def module_slices(model: dict, rank_index: CheckpointIndex) -> dict:
    """The model file's dense module weights: the rank's slices (the same bytes at the source's tp)."""
    module = model.get("module")
    if isinstance(module, dict):
        model["module"] = type(module)(
            (k, LazyTensor(rank_index.tensors[f"ds_module.{k}"]) if f"ds_module.{k}" in rank_index.tensors else v)
            for k, v in module.items()
        )
    return model


def record_tp_sizes(model: dict, target: TpTarget) -> dict:
    """What DeepSpeed records of the sizes in a model-states file, for the new ones."""
    model["mp_world_size"] = target.tp * target.pp
    model["dp_world_size"] = target.dp
    if isinstance(model.get("checkpoint_parallel_dimensions"), dict):
        model["checkpoint_parallel_dimensions"] = {**model["checkpoint_parallel_dimensions"], "tp_degree": target.tp}
    uc = model.get("universal_checkpoint_info")
    if isinstance(uc, dict) and isinstance(uc.get("affine_map"), dict):
        model["universal_checkpoint_info"] = affine_map_for(uc, target.tp, target.shares)
    return model


def local_pipeline(pinfo: DeepSpeedNative, rank_index: CheckpointIndex) -> DeepSpeedNative:
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


def layer_states(index: CheckpointIndex, lane: Lane, tag: str) -> dict[str, Any]:
    """A sliced pipeline lane's layer files: each layer's state dict on the new tp rank."""
    return {
        f"{tag}/{layer_file(layer, lane.rank)}": _layer_state(index, lane.native, lane.index, layer)
        for layer in sorted(lane.native.layer_files)
    }


def _layer_state(
    index: CheckpointIndex, pinfo: DeepSpeedNative, rank_index: CheckpointIndex, layer: int
) -> OrderedDict:
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
