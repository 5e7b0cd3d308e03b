"""A legacy Megatron-LM iteration folder (`mp_rank_TT[_PPP]/model_optim_rng.pt`, one torch.save
file per tensor and pipeline rank) read as ONE checkpoint: each model tensor made of its ranks'
parts, placed by Megatron's split rules; nothing is read but the files' indexes.

The rules (megatron/core/tensor_parallel/layers.py, transformer/attention.py and mlp.py, 0.16.1):
- column-parallel, split on dim 0: `linear_qkv`, `linear_fc1` (weight and bias), the word
  embedding (VocabParallelEmbedding) and `output_layer`. GQA's fused `linear_qkv` is laid out
  group by group ([q of the group's heads; k; v] per query group) and each rank holds whole,
  consecutive groups, so its parts join on dim 0 as they are.
- SwiGLU (`args.swiglu`): each rank's `linear_fc1` is `[gate_r; up_r]`; the whole one is
  `[gate_0; gate_1; ...; up_0; up_1; ...]` (the TP1 layout, `chunk(2)` in the forward), so each
  rank's two halves are placed apart.
- row-parallel, split on dim 1: `linear_proj`, `linear_fc2` weights; their biases are whole on
  every rank.
- whole on every rank: layer norms (`*layernorm*`, `layer_norm_*`), `position_embeddings`.
- pipeline stages number their layers from 0: a stage's layers are placed after those of the
  stages before it (counted in the files, so an uneven split is placed right).
Anything else (a tensor no rule names, expert-parallel folders `_EEE`, virtual pipeline chunks
`model0`, a folder set the args do not describe) is refused in one sentence naming it. The
optimizer state, keyed by parameter number per rank, is not joined: it is said not read.
"""

from __future__ import annotations

import re

from ...errors import FormatError, UnsupportedError
from ...index.types import CheckpointIndex, ObjectEntry, Piece, TensorEntry, unchecked_box, unchecked_location
from ...index.dtypes import itemsize
from ...storage.source import Source
from ..torch_save import reader as ts_reader
from .args import MegatronArgs, megatron_args
from .legacy import RANK_FILE

RANK_PARTS = re.compile(r"mp_rank_([0-9]{2})(?:_([0-9]{3}))?(?:_([0-9]{3}))?")
LAYER = re.compile(r"decoder\.layers\.([0-9]+)\.")
COLUMN = re.compile(
    r"(?:.*\.)?(?:linear_qkv|linear_fc1)\.(?:weight|bias)|embedding\.word_embeddings\.weight|output_layer\.weight"
)
ROW = re.compile(r".*\.(?:linear_proj|linear_fc2)\.weight")
WHOLE = re.compile(
    r".*(?:layernorm|layer_norm_weight|layer_norm_bias|norm\.weight|norm\.bias)"
    r"|.*\.(?:linear_proj|linear_fc2)\.bias|embedding\.position_embeddings\.weight"
)
FC1 = re.compile(r"(?:.*\.)?linear_fc1\.(?:weight|bias)")
OPTIMIZER_UNREAD = (
    "optimizer state of a legacy Megatron-LM checkpoint (keyed by parameter number on each rank: not joined)"
)
LEGACY_KEY = "megatron_legacy"  # index.metadata: the rank folders joined (training.py refuses their optimizer)


def read_joined(source: Source, folders: list[str]) -> CheckpointIndex:
    """The one checkpoint the rank folders of an iteration folder (`source`) hold."""
    ranks = _ranks(source, folders)
    files = {at: ts_reader.read_index(source, f"{folder}/{RANK_FILE}") for at, folder in ranks.items()}
    first = files[min(files)]
    args = _args(source, first, ranks)
    index = CheckpointIndex(format="mcore", root=source.root)
    for part in files.values():
        index.files.update(part.files)
        index.checks.extend(part.checks)
    stages = sorted({pp for _, pp in files})
    offset = 0
    tied_out = False
    for pp in stages:
        parts = [files[(tp, pp)] for tp in range(args.tp or 1)]
        models = [_model(p, source.label(f"{ranks[(tp, pp)]}/{RANK_FILE}")) for tp, p in enumerate(parts)]
        layers = {int(m.group(1)) for name in models[0] if (m := LAYER.match(name))}
        for name in models[0]:
            joined = _renumbered(name, offset)
            if args.tied and pp != stages[0] and name == "output_layer.weight":
                tied_out = True  # the last stage's copy of the word embedding
                continue
            entry = _joined(joined, [m.get(name) for m in models], args, source, ranks, pp)
            index.add_tensor(entry)
        for key, o in parts[0].objects.items():
            path = tuple(o.path or (key,))
            if path[0] == "model" and len(path) == 2:
                name = _renumbered(path[1], offset)
                index.add_object(ObjectEntry(name, o.data, ("model", name), o.location))
        offset += len(layers)
    _carry_values(index, files, ranks)
    _describe(index, args, len(files), tied_out)
    return index


def _ranks(source: Source, folders: list[str]) -> dict[tuple[int, int], str]:
    ranks: dict[tuple[int, int], str] = {}
    for folder in folders:
        found = RANK_PARTS.fullmatch(folder)
        if found is None:
            raise FormatError(f"{source.label(folder)}: not a Megatron-LM rank folder name (mp_rank_TT[_PPP])")
        if found.group(3) is not None:
            raise UnsupportedError(
                f"{source.label(folder)}: is an expert-parallel rank folder (mp_rank_TT_PPP_EEE); joining a legacy "
                f"Megatron-LM checkpoint's expert ranks is not supported yet"
            )
        ranks[(int(found.group(1)), int(found.group(2) or 0))] = folder
    return ranks


def _args(source: Source, first: CheckpointIndex, ranks: dict[tuple[int, int], str]) -> MegatronArgs:
    """The args of the first rank file, checked to describe exactly the rank folders there are."""
    held = first.objects.get("args")
    args = megatron_args(held.data) if held is not None else None
    where = source.label(f"{ranks[min(ranks)]}/{RANK_FILE}")
    if args is None or args.tp is None or args.pp is None:
        raise FormatError(f"{where}: holds no Megatron args with its tensor and pipeline parallel sizes")
    want = {(tp, pp) for tp in range(args.tp) for pp in range(args.pp)}
    if set(ranks) != want:
        raise FormatError(
            f"{source.root}: holds {len(ranks)} rank folder(s), but its args say tensor_model_parallel_size="
            f"{args.tp} and pipeline_model_parallel_size={args.pp} ({len(want)} ranks): a rank's part is missing "
            f"or extra"
        )
    return args


def _model(part: CheckpointIndex, where: str) -> dict[str, TensorEntry]:
    """A rank file's model tensors by name (virtual pipeline chunks refused)."""
    heads = {tuple(e.path or (k,))[0] for k, e in part.tensors.items()}
    if any(isinstance(h, str) and re.fullmatch(r"model[0-9]+", h) for h in heads):
        raise UnsupportedError(
            f"{where}: holds virtual pipeline chunks (model0, model1, ...); joining them is not supported yet"
        )
    return {e.path[1]: e for k, e in part.tensors.items() if e.path and len(e.path) == 2 and e.path[0] == "model"}


def _renumbered(name: str, offset: int) -> str:
    found = LAYER.match(name)
    if found is None or not offset:
        return name
    return f"decoder.layers.{int(found.group(1)) + offset}.{name[found.end() :]}"


def _joined(
    name: str, parts: list[TensorEntry | None], args: MegatronArgs, source: Source, ranks: dict, pp: int
) -> TensorEntry:
    """One tensor of the whole model from its tensor-parallel ranks' parts (Megatron's rules)."""
    if any(p is None for p in parts):
        missing = next(tp for tp, p in enumerate(parts) if p is None)
        raise FormatError(f"{source.label(ranks[(missing, pp)])}: has no tensor {name}, which rank 0 of its stage has")
    base = _base_name(name)
    first = parts[0]
    if len(parts) == 1 or WHOLE.fullmatch(base):
        _same_shapes(name, parts, None)
        return TensorEntry(name, first.dtype, tuple(first.shape), list(first.pieces), ("model", name))
    if ROW.fullmatch(base):
        return _concat(name, parts, 1)
    if COLUMN.fullmatch(base):
        if args.swiglu and FC1.fullmatch(base):
            return _swiglu(name, parts)
        return _concat(name, parts, 0)
    raise UnsupportedError(
        f"{source.root}: tensor {name} is split over tensor-parallel ranks by no rule ckptkit knows "
        f"(column-parallel linear_qkv/linear_fc1/embeddings, row-parallel linear_proj/linear_fc2, layer norms "
        f"whole); its ranks cannot be joined"
    )


def _base_name(name: str) -> str:
    return LAYER.sub("", name, count=1)


def _same_shapes(name: str, parts: list[TensorEntry], dim: int | None) -> None:
    shapes = [tuple(p.shape) for p in parts]
    keep = [tuple(s[:dim] + s[dim + 1 :]) if dim is not None else s for s in shapes]
    if len(set(keep)) != 1 or any(p.dtype != parts[0].dtype for p in parts):
        raise FormatError(f"tensor {name}: its ranks' parts do not fit together ({', '.join(map(str, shapes))})")


def _concat(name: str, parts: list[TensorEntry], dim: int) -> TensorEntry:
    _same_shapes(name, parts, dim)
    pieces, at = [], 0
    for part in parts:
        for piece in part.pieces:
            offsets = list(piece.region.offsets)
            offsets[dim] += at
            pieces.append(Piece(unchecked_box(tuple(offsets), piece.region.sizes), piece.location))
        at += part.shape[dim]
    shape = list(parts[0].shape)
    shape[dim] = at
    return TensorEntry(name, parts[0].dtype, tuple(shape), pieces, ("model", name))


def _swiglu(name: str, parts: list[TensorEntry]) -> TensorEntry:
    """SwiGLU's fc1: rank r's rows [gate_r; up_r] placed at gate_all and up_all's rows."""
    _same_shapes(name, parts, 0)
    total = sum(p.shape[0] for p in parts)
    pieces, at = [], 0
    for part in parts:
        half = part.shape[0] // 2
        if part.shape[0] % 2 or len(part.pieces) != 1:
            raise FormatError(f"tensor {name}: a SwiGLU rank part of {part.shape[0]} rows cannot be halved")
        for k, start in enumerate((at, total // 2 + at)):
            sizes = (half, *part.shape[1:])
            pieces.append(Piece(unchecked_box((start,) + (0,) * (len(sizes) - 1), sizes), _rows(part, k * half, half)))
        at += half
    return TensorEntry(name, parts[0].dtype, (total, *parts[0].shape[1:]), pieces, ("model", name))


def _rows(part: TensorEntry, start: int, count: int):
    """The location of rows [start, start + count) of a part stored whole and row-major."""
    loc = part.pieces[0].location
    if loc.stride is not None or loc.transforms:
        raise FormatError(f"{loc.file}: tensor {part.key} is not stored row-major; its SwiGLU halves cannot be cut")
    row = itemsize(part.dtype)
    for n in part.shape[1:]:
        row *= n
    return unchecked_location(loc.file, loc.offset + start * row, count * row, loc.encoding, None, loc.transforms)


def _carry_values(index: CheckpointIndex, files: dict, ranks: dict) -> None:
    """args, iteration and the other top-level values of the first rank; each rank's rng_state."""
    first = files[min(files)]
    for key, o in first.objects.items():
        path = tuple(o.path or (key,))
        if path[0] in ("model", "optimizer", "rng_state") or path[0].startswith("model"):
            continue
        index.add_object(o)
    for at, part in sorted(files.items()):
        for key, o in part.objects.items():
            path = tuple(o.path or (key,))
            if path[0] == "rng_state":
                new = ("rng_state", ranks[at]) + path[1:]
                index.add_object(ObjectEntry(".".join(map(str, new)), o.data, new, o.location))
    iteration = first.objects.get("iteration")
    if iteration is not None and type(iteration.data) is int:
        index.step = iteration.data
    index.metadata.setdefault("unread", {})["optimizer"] = OPTIMIZER_UNREAD


def _describe(index: CheckpointIndex, args: MegatronArgs, n_files: int, tied_out: bool) -> None:
    index.world_size = args.world_size
    sizes = (("tp", args.tp), ("pp", args.pp), ("ep", args.ep), ("dp", args.dp))
    index.metadata["parallel"] = {axis: size for axis, size in sizes if size}
    index.metadata["megatron_args"] = args.as_json()
    index.metadata[LEGACY_KEY] = n_files
    note = (
        f"Megatron-LM legacy checkpoint: {n_files} rank files (tp {args.tp} x pp {args.pp}) joined into "
        f"{len(index.tensors)} model tensors by Megatron's split rules"
    )
    if tied_out:
        note += "; the last stage's output_layer.weight is its copy of the tied word embedding, not kept"
    index.metadata.setdefault("notes", []).append(note)
