"""Where Megatron-Core's `dist_checkpointing.save` puts each chunk for a target layout.

A torch_dist checkpoint holds every tensor at its global shape whatever the layout: the layers of
the decoder stacked under `decoder.layers.X` [L, ...] at their global indices, tensor-parallel
weights whole. Only the chunking depends on the layout, and that is what this module computes,
as MCore's model `sharded_state_dict` (local layer spec) cuts it:

* each layer of a stacked tensor is its own chunk, written by the pipeline stage that owns the
  layer (MCore's even split: layer i on stage i // (L / pp));
* column-parallel weights (`linear_qkv`, `linear_fc1`, the word embedding, the output layer) are
  split on their output axis over tp ranks, row-parallel ones (`linear_proj`, `linear_fc2`) on
  their input axis; SwiGLU's `linear_fc1` is stored `[gate_all; up_all]`, so each tp rank holds
  two chunks, one in each half (at tp 1 too); everything else is replicated;
* a replicated chunk is written once, by its first rank (tp rank 0, dp rank 0): MCore writes the
  replica whose replica_id is all zeros.

Ranks are numbered as MCore's default order `tp-cp-ep-dp-pp` numbers them: tp fastest, then dp,
then pp. Optimizer state that is in model space (`optimizer.state.<state>.<param>`, a
fully_reshardable distributed optimizer's included) is chunked as its parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import UnsupportedError
from ...index.layouts import Assignment, Layout
from ...index.types import Box, CheckpointIndex
from .names import role_of

STACKED = "decoder.layers."
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
FIRST_STAGE = ("embedding.",)
LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")
SHARDED_OBJECT = re.compile(r"(?P<key>.+)/shard_(?P<offsets>[0-9.]*)_(?P<shape>[0-9.]*)")
FC1 = STACKED + "mlp.linear_fc1.weight"
FC2 = STACKED + "mlp.linear_fc2.weight"


@dataclass(frozen=True)
class McoreLayout:
    """A target layout: sizes, and the model facts the chunking needs."""

    tp: int
    pp: int
    dp: int
    num_layers: int
    gated: bool  # SwiGLU: linear_fc1 holds [gate; up]

    def rank(self, tp_rank: int, stage: int) -> int:
        """The global rank of (tp rank, dp rank 0, stage) in MCore's tp-dp-pp order."""
        return tp_rank + self.tp * self.dp * stage

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def stage_of_layer(self, layer: int) -> int:
        return layer // (self.num_layers // self.pp)

    def stage_of(self, name: str) -> int:
        """The pipeline stage holding a tensor that is not stacked by layer."""
        if name.startswith(LAST_STAGE):
            return self.pp - 1
        return 0


def param_of(key: str) -> str:
    """The model parameter a key is (its own key for the model, the parameter of optimizer state)."""
    role = role_of(key)
    return role.path[2] if role.kind == "optimizer" else key


def tp_axis(name: str) -> int | None:
    """The axis of the unstacked parameter `name` that tp splits (None: replicated)."""
    if name in VOCAB_PARALLEL:
        return 0
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def is_gated(index: CheckpointIndex) -> bool:
    """SwiGLU: linear_fc1 has twice the rows linear_fc2 has columns (whatever the layout)."""
    fc1, fc2 = index.tensors.get(FC1), index.tensors.get(FC2)
    if fc1 is None or fc2 is None or len(fc1.shape) != 3 or len(fc2.shape) != 3:
        return False
    return fc1.shape[1] == 2 * fc2.shape[2]


def num_layers(index: CheckpointIndex) -> int | None:
    """L, the leading size of the stacked tensors (None: no decoder layers)."""
    sizes = {e.shape[0] for k, e in index.tensors.items() if param_of(k).startswith(STACKED) and e.shape}
    if len(sizes) > 1:
        raise UnsupportedError(f"{index.root}: its stacked decoder tensors disagree on the layer count {sorted(sizes)}")
    return sizes.pop() if sizes else None


def tp_boxes(name: str, shape: tuple[int, ...], lead: int, target: McoreLayout, where: str) -> list[list[Box]]:
    """For each tp rank, the boxes it holds of the tensor `name` ([lead leading indices] + the
    parameter's shape): one rank holding all of it when replicated."""
    axis = tp_axis(name)
    whole = Box(tuple(0 for _ in shape), tuple(shape))
    gated = target.gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias"))
    if axis is None or (target.tp == 1 and not gated) or len(shape) <= lead + axis:
        return [[whole]]
    at = lead + axis
    halves = 2 if gated else 1
    size = shape[at] // halves
    if size * halves != shape[at] or size % target.tp:
        raise UnsupportedError(
            f"{where}: {name} has {shape[at]} {'rows' if axis == 0 else 'columns'}"
            f"{' (gate and up halves)' if gated else ''}, which tp={target.tp} does not split evenly"
        )
    part = size // target.tp
    ranks = []
    for r in range(target.tp):
        boxes = []
        for h in range(halves):
            offsets = list(whole.offsets)
            sizes = list(shape)
            offsets[at], sizes[at] = h * size + r * part, part
            boxes.append(Box(tuple(offsets), tuple(sizes)))
        ranks.append(boxes)
    return ranks


def tensor_assignments(key: str, shape: tuple[int, ...], target: McoreLayout, where: str) -> list[Assignment]:
    """The chunks of one tensor and the rank writing each."""
    name = param_of(key)
    if not shape:
        return [Assignment(target.rank(0, target.stage_of(name)), Box((), ()))]
    if not name.startswith(STACKED):
        stage = target.stage_of(name)
        parts = tp_boxes(name, shape, 0, target, where)
        return [Assignment(target.rank(r, stage), box) for r, boxes in enumerate(parts) for box in boxes]
    unstacked = name[len(STACKED) :]
    parts = tp_boxes(unstacked, shape, 1, target, where)
    out = []
    for layer in range(shape[0]):
        stage = target.stage_of_layer(layer)
        for r, boxes in enumerate(parts):
            for box in boxes:
                out.append(
                    Assignment(target.rank(r, stage), Box((layer,) + box.offsets[1:], (1,) + tuple(box.sizes[1:])))
                )
    return out


def object_rank(key: str, target: McoreLayout) -> int:
    """The rank writing a sharded object (`<key>/shard_<offsets>_<shape>`): a layer's on the stage
    holding the layer, others on the stage holding their module."""
    found = SHARDED_OBJECT.fullmatch(key)
    name = found.group("key") if found else key
    if found and name.startswith(STACKED) and found.group("offsets"):
        return target.rank(0, target.stage_of_layer(int(found.group("offsets").split(".")[0])))
    return target.rank(0, target.stage_of(name))


def mcore_layout(
    index: CheckpointIndex, target: McoreLayout, keys: list[str], objects: list[str], where: str | None = None
) -> Layout:
    """The Layout (index/layouts.py) of `keys` and `objects` at `target`, whole chunks as MCore writes
    them (`where`: the source as refusals name it)."""
    layout = Layout(
        target.world_size,
        description=f"Megatron-Core tp={target.tp},pp={target.pp},dp={target.dp}",
        exact_chunks=True,
        object_ranks={k: object_rank(k, target) for k in objects},
    )
    for key in keys:
        layout.tensors[key] = tensor_assignments(key, tuple(index.tensors[key].shape), target, where or index.root)
    return layout
