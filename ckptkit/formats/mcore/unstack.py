"""Consolidate's view of a Megatron-Core model: one tensor per layer and expert, named as an MCore
model's `state_dict()` names them, instead of the stacked tensors torch_dist saves.

MCore's `sharded_state_dict` stacks every layer of the decoder under one key, `decoder.layers.X`
of shape [L, ...] over all layers of the model (each pipeline stage writes its layers at their
global index), and a SequentialMLP's experts under `decoder.layers.mlp.experts.experts.X`
[L, E, ...]. Layer i of it is `decoder.layers.{i}.X`, expert e of layer i
`decoder.layers.{i}.mlp.experts.local_experts.{e}.X`. Each is an index view into the stacked
tensor's pieces (the pieces holding it, their byte ranges narrowed), so consolidate streams it in
bounded memory like any other tensor; nothing is read here.
"""

from __future__ import annotations

import math

from ...errors import FormatError, UsageError
from ...index.dtypes import itemsize
from ...index.types import CheckpointIndex, Encoding, Piece, TensorEntry, unchecked_box, unchecked_location
from .names import FLAT_BUFFER
from .optim_names import EXPERTS, LOCAL_EXPERTS, STACKED, layer_names  # noqa: F401 (names of the layout)

EXTRA_STATE = "_extra_state"
OUTPUT_LAYER = "output_layer.weight"

OPTIMIZER_HINT = "consolidate_optimizer_hint"  # (read by ops/consolidate.py, which names it so too)
TRAINING_VIEW = "mcore_view"  # index.metadata: "training" on training.py's view (named per layer already)
OPTIMIZER_REFUSAL = (
    "--include-optimizer reads a Megatron-Core checkpoint through its training view (per layer), "
    "which this index is not"
)


def consolidated_model(
    index: CheckpointIndex, model: dict[str, str], include_optimizer: bool
) -> tuple[dict[str, str], dict[str, TensorEntry], list[str]]:
    """`model` (output name -> index key) with each stacked tensor replaced by its layers (and
    experts); the entries made for them by name; and notes on what was renamed or left out."""
    if include_optimizer:  # consolidate reads the training view then (training.py): already per layer
        if index.metadata.get(TRAINING_VIEW) != "training":
            raise UsageError(f"{index.root}: {OPTIMIZER_REFUSAL}")
        return dict(model), {}, []
    if any(FLAT_BUFFER.fullmatch(k) for k in index.tensors):
        index.metadata[OPTIMIZER_HINT] = "dp_reshardable flat buffers: not mappable to parameters"
    tied = (index.metadata.get("megatron_args") or {}).get("tied")
    names: dict[str, str] = {}
    made: dict[str, TensorEntry] = {}
    stacked = left_out = 0
    for name, key in model.items():
        if name.endswith(EXTRA_STATE) or (tied and name == OUTPUT_LAYER):
            left_out += 1
            continue
        entry = index.tensors[key]
        if len(_slices(name, entry)[0][1]) == 0:  # not stacked (a layer's own tensor: a legacy folder's)
            names[name] = key
            continue
        stacked += 1
        for out_name, at in _slices(name, entry):
            made[out_name] = layer_view(entry, at, out_name)
            names[out_name] = out_name
    return names, made, _notes(stacked, len(made), tied and OUTPUT_LAYER in model, left_out)


def _slices(name: str, entry: TensorEntry):
    """(output name, leading indices) of each layer, and of each expert of each layer."""
    return layer_names(name, tuple(entry.shape))


def layer_view(entry: TensorEntry, at: tuple[int, ...], name: str) -> TensorEntry:
    """The sub-tensor `entry[at]` (leading indices) as an entry whose pieces point into the
    stacked tensor's bytes: the pieces that hold it, each narrowed to it."""
    k = len(at)
    pieces = []
    for piece in entry.pieces:
        box = piece.region
        if not hasattr(box, "offsets"):
            raise FormatError(f"{entry.key}: a stacked MCore tensor stored as a flat range cannot be split by layer")
        inner = tuple(a - o for a, o in zip(at, box.offsets[:k]))
        if any(not 0 <= j < n for j, n in zip(inner, box.sizes[:k])):
            continue
        region = unchecked_box(box.offsets[k:], box.sizes[k:])
        pieces.append(Piece(region, _narrowed(piece, inner, entry, name)))
    return TensorEntry(name, entry.dtype, entry.shape[k:], pieces, (name,), dict(entry.attrs))


def _narrowed(piece: Piece, inner: tuple[int, ...], entry: TensorEntry, name: str):
    """The location of `piece[inner]`: the same bytes when the piece holds that one slice only,
    else (raw elements) the byte range and strides of the slice."""
    loc, sizes, k = piece.location, piece.region.sizes, len(inner)
    if all(n == 1 for n in sizes[:k]):
        stride = loc.stride[k:] if loc.stride is not None else None
        return unchecked_location(loc.file, loc.offset, loc.length, loc.encoding, stride, loc.transforms)
    if loc.encoding != Encoding.RAW or loc.transforms:
        raise FormatError(
            f"{loc.file}: a piece of {entry.key} holds several layers in {loc.encoding} encoding; "
            f"{name} cannot be read from it alone"
        )
    stride = loc.stride if loc.stride is not None else _row_major(sizes)
    size = itemsize(entry.dtype)
    rest_sizes, rest_stride = sizes[k:], stride[k:]
    start = loc.offset + sum(j * s for j, s in zip(inner, stride)) * size
    count = math.prod(rest_sizes)
    span = 0 if count == 0 else (sum((n - 1) * s for n, s in zip(rest_sizes, rest_stride)) + 1) * size
    return unchecked_location(
        loc.file, start, span, loc.encoding, rest_stride if loc.stride is not None else None, loc.transforms
    )


def _row_major(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(sizes):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _notes(stacked: int, made: int, tied_out: bool, left_out: int) -> list[str]:
    notes = []
    if stacked:
        notes.append(
            f"names: {stacked} stacked tensors (decoder.layers.X [L, ...]) written as {made} tensors, one per "
            f"layer and expert, named as an MCore model's state_dict() names them (decoder.layers.<i>.X)"
        )
    if tied_out:
        notes.append(f"not written: {OUTPUT_LAYER} (args say it is tied to the word embedding)")
    extra = left_out - bool(tied_out)
    if extra:
        notes.append(f"not written: {extra} {EXTRA_STATE} tensors (MCore's module state, not weights)")
    return notes
