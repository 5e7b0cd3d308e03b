"""How one parameter's full tensor maps to the pieces its tensor-parallel ranks hold, in both
directions: `join` (the reader: rank slices on disk -> pieces of the full tensor) and `split` (the
writers: the full tensor -> each new rank's slice, as flat runs of it).

A `TpGeometry` is the one description both derive from, as DeepSpeed's `checkpoint/affine.py`
derives `rebuild` and `extract` from one `ParamAffineMap` (and Megatron's `merge_fn` and
`build_fn` from one sharding): the split dimension (None: replicated, every rank holds the whole
tensor) and the sizes of the blocks along it in the full tensor (one block for a plain split;
Megatron's fused QKV: three, rank r holding [q_r; k_r; v_r]). Rank r's share of a block of size p
is the run at the block's start + r * p/tp, of size p/tp, placed after its shares of the blocks
before it.

The same geometry gives DeepSpeed's own record of a split, the `affine_map` AutoTP saves in
`universal_checkpoint_info` (`affine_ranks`, `affine_map_for`): each rank's shard shape and the
piece of the logical tensor it holds.

The split rule of a parameter (convert/tp_rules.py) says what it is; `for_slices` builds its
geometry from the ranks' slice shape (reading) and `for_full` from the full tensor's (writing),
each refusing, in its own words, sizes the ranks cannot share equally.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

from ...convert.tp_rules import TpSplit
from ...errors import UnsupportedError, UsageError, quote
from ...index.dtypes import itemsize
from ...index.geometry import flat_to_boxes
from ...index.strides import row_major_strides, strided_span
from ...index.types import Box, CheckpointIndex, Encoding, FlatRange, Location, Piece, TensorEntry
from ...index.virtual import Part, flat_concat

FULL = "tp.full:"  # hidden keys of the full tensors in a rank index


@dataclass(frozen=True)
class TpBlock:
    """One block of the split dimension as one rank holds it: where it starts in the rank's
    slice, its size there, and where that share starts in the full tensor."""

    local_start: int
    local_size: int
    full_start: int


@dataclass(frozen=True)
class TpGeometry:
    """A parameter split over `tp` ranks along `dim` in blocks of `parts` (full-tensor sizes);
    `dim` None: replicated. Each rank holds `part // tp` of every block, or, where `shares` is
    given (one tuple per block, each rank's size in it), its own share: uneven splits, as
    DeepSpeed's AutoTP cuts a size tp does not divide."""

    tp: int
    dim: int | None
    parts: tuple[int, ...] = ()
    shares: tuple[tuple[int, ...], ...] | None = None

    def share(self, block: int, rank: int) -> int:
        """Rank `rank`'s size in block `block`."""
        if self.shares is not None:
            return self.shares[block][rank]
        return self.parts[block] // self.tp

    def blocks(self, rank: int) -> list[TpBlock]:
        """Rank `rank`'s share of every block, in the order its slice holds them."""
        out, local_start, full_start = [], 0, 0
        for i, part in enumerate(self.parts):
            size = self.share(i, rank)
            before = sum(self.share(i, r) for r in range(rank))
            out.append(TpBlock(local_start, size, full_start + before))
            local_start += size
            full_start += part
        return out

    def local_shape(self, full: tuple[int, ...], rank: int = 0) -> tuple[int, ...]:
        """Rank `rank`'s slice shape for the full shape `full`."""
        if self.dim is None:
            return tuple(full)
        local = sum(self.share(i, rank) for i in range(len(self.parts)))
        return tuple(full[: self.dim]) + (local,) + tuple(full[self.dim + 1 :])

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The full shape for a rank's slice shape `local` (its other dimensions)."""
        if self.dim is None:
            return tuple(local)
        return tuple(local[: self.dim]) + (sum(self.parts),) + tuple(local[self.dim + 1 :])

    def split(self, ref: str, full: tuple[int, ...], rank: int) -> list[Part]:
        """Rank `rank`'s slice of the full tensor `ref` (shape `full`): its row-major flat runs,
        merged when adjacent (replicated: the whole tensor)."""
        if self.dim is None:
            return [Part(ref, 0, math.prod(full))]
        dim = self.dim
        outer, inner, length = math.prod(full[:dim]), math.prod(full[dim + 1 :]), full[dim]
        parts: list[Part] = []
        for o in range(outer):
            for b in self.blocks(rank):
                begin = (o * length + b.full_start) * inner
                if parts and parts[-1].start + parts[-1].length == begin:
                    parts[-1] = Part(ref, parts[-1].start, parts[-1].length + b.local_size * inner)
                else:
                    parts.append(Part(ref, begin, b.local_size * inner))
        return parts

    def affine_ranks(self, logical: tuple[int, ...]) -> dict[int, dict]:
        """Each rank's record in AutoTP's `affine_map` for the full (logical) shape: its shard shape
        and the pieces of the logical tensor it holds, as offsets and row-major strides (replicated:
        the whole tensor, at every rank's location). One block only, as AutoTP splits, evenly or by
        `shares`; the logical tensor's stride list is shared between the records."""
        strides = _strides(logical)
        if self.dim is None:
            return {
                r: {
                    "shard_shape": list(logical),
                    "pieces": [
                        {
                            "shape": list(logical),
                            "source": [0, strides],
                            "dest": [0, strides],
                            "locations": list(range(self.tp)),
                        }
                    ],
                }
                for r in range(self.tp)
            }
        out = {}
        for r in range(self.tp):
            (block,) = self.blocks(r)
            local = self.local_shape(logical, r)
            piece = {
                "shape": list(local),
                "source": [block.full_start * strides[self.dim], strides],
                "dest": [0, _strides(local)],
                "locations": [r],
            }
            out[r] = {"shard_shape": list(local), "pieces": [piece]}
        return out

    def join(self, entries: list[TensorEntry]) -> list[Piece]:
        """The full tensor's pieces from every rank's slice entry (their pieces placed where the
        rank's share lies; replicated: rank 0's)."""
        if self.dim is None:
            return list(entries[0].pieces)
        full = self.full_shape(tuple(entries[0].shape))
        pieces: list[Piece] = []
        for rank, entry in enumerate(entries):
            pieces.extend(place(entry, tuple(entry.shape), full, self.dim, self.blocks(rank)))
        return pieces


def for_slices(split: TpSplit, local: tuple[int, ...], dim: int, tp: int, key: str) -> TpGeometry:
    """The geometry of a parameter read as `tp` slices of shape `local`, split along `dim`."""
    if split.kind != "fused":
        return TpGeometry(tp, dim, (local[dim] * tp,))
    if split.parts is not None:
        if any(p % tp for p in split.parts) or sum(split.parts) != local[dim] * tp:
            raise UnsupportedError(
                f"{key}: rule {quote(split.rule)} fuses blocks {list(split.parts)} along dim "
                f"{dim}, which {tp} tensor-parallel slices of {local[dim]} cannot hold"
            )
        return TpGeometry(tp, dim, tuple(split.parts))
    count = split.count or 1
    if local[dim] % count:
        raise UnsupportedError(
            f"{key}: rule {quote(split.rule)} fuses {count} equal blocks along dim {dim}, "
            f"but a tensor-parallel slice has {local[dim]} there"
        )
    return TpGeometry(tp, dim, (local[dim] // count * tp,) * count)


def for_uneven_slices(
    split: TpSplit, shapes: list[tuple[int, ...]], dim: int, tp: int, key: str, label: str
) -> TpGeometry:
    """The geometry of a parameter whose `tp` slices (shapes `shapes`, in rank order) differ in
    length along the split dimension `dim` only: joined in rank order, each rank's length its own.
    Slices that differ elsewhere, or a fused tensor's (whose blocks' shares the slices do not
    say), are refused."""
    first = shapes[0]
    others_equal = all(s[:dim] + s[dim + 1 :] == first[:dim] + first[dim + 1 :] for s in shapes)
    listed = [list(s) for s in shapes]
    if not others_equal:
        raise UnsupportedError(
            f"{label}: {key}: its tensor-parallel slices differ in shape ({listed}) along more than "
            f"the dimension {dim} rule {quote(split.rule)} splits, so they are not slices of one tensor"
        )
    if split.kind == "fused":
        raise UnsupportedError(
            f"{label}: {key}: its tensor-parallel slices differ in shape ({listed}), and rule "
            f"{quote(split.rule)} fuses blocks along dim {dim}, whose share on each rank the slices "
            f"do not say; an uneven split of fused blocks is not supported"
        )
    sizes = tuple(s[dim] for s in shapes)
    return TpGeometry(tp, dim, (sum(sizes),), (sizes,))


def for_full(
    split: TpSplit | None,
    full: tuple[int, ...],
    dim: int | None,
    tp: int,
    key: str,
    shares: tuple[int, ...] | None = None,
    reason: str = "",
) -> TpGeometry:
    """The geometry of the full tensor `key` (shape `full`, split along `dim`, None when whole) cut
    for `tp` ranks: equally, or each rank its size of `shares` (a plain split's uneven cut);
    UsageError when they cannot share it equally (`reason`, when given, ends the sentence)."""
    if dim is None:
        return TpGeometry(tp, None)
    length = full[dim]
    if shares is not None and not (split is not None and split.kind == "fused"):
        return TpGeometry(tp, dim, (length,), (tuple(shares),))
    if split is not None and split.kind == "fused":
        count = split.count or 1
        parts = list(split.parts) if split.parts is not None else [length // count] * count
    else:
        parts = [length]
    if sum(parts) != length or any(p % tp for p in parts):
        what = f"its fused parts {parts}" if len(parts) > 1 else f"its size {length}"
        raise UsageError(
            f"--to tp={tp}: {quote(key)} is split along dim {dim} with {what}, which "
            f"{tp} tensor-parallel ranks cannot share equally{reason}"
        )
    return TpGeometry(tp, dim, tuple(parts))


def affine_map_for(uc: dict, tp: int, shares: dict[str, tuple[int, ...]] | None = None) -> dict:
    """`universal_checkpoint_info` with AutoTP's affine_map redone for `tp` ranks: each parameter
    split along the one dimension its recorded shard differs in (one piece: evenly, or by its
    `shares`, the sizes of a parameter cut unevenly, by name), or replicated where none differs;
    records of other shapes are left as they are."""
    uc = copy.deepcopy(uc)
    for pattern, rec in uc["affine_map"].get("params", {}).items():
        try:
            logical = tuple(int(x) for x in rec["logical_shape"])
            old = rec["ranks"][0]
            shard = [int(x) for x in old["shard_shape"]]
        except (KeyError, TypeError, ValueError, IndexError):
            continue
        diff = [i for i, (a, b) in enumerate(zip(logical, shard)) if a != b]
        if not diff:
            rec["ranks"] = TpGeometry(tp, None).affine_ranks(logical)
        elif len(diff) == 1 and len(old.get("pieces", [])) == 1:
            dim, sizes = diff[0], (shares or {}).get(_unescaped(pattern))
            rec["ranks"] = TpGeometry(tp, dim, (logical[dim],), (sizes,) if sizes else None).affine_ranks(logical)
    return uc


def _unescaped(pattern: str) -> str:
    """The parameter name of AutoTP's pattern `^escaped\\.name$`."""
    return re.sub(r"\\(.)", r"\1", pattern.removeprefix("^").removesuffix("$"))


def _strides(shape: tuple[int, ...]) -> list[int]:
    """Row-major strides as DeepSpeed's affine map records them (a zero size gives zeros)."""
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def param_name(e: TensorEntry) -> str | None:
    """The parameter an entry belongs to: model.<name>, optim.state.<name>.<key>, ds_module.<name>."""
    path = e.path or ()
    if len(path) == 2 and path[0] in ("model", "ds_module"):
        return str(path[1])
    if len(path) == 4 and path[:2] == ("optim", "state"):
        return str(path[2])
    return None


class TpSlicer:
    """Each new tp rank's slice of every full tensor of a joined index, as REF runs of the full
    one. `splits` (name -> TpSplit) are the ones the reader decided; a tensor's split dimension is
    its attrs["parallel"]["tp"]["dim"]."""

    def __init__(self, index: CheckpointIndex, splits: dict[str, TpSplit], tp: int, cut: Any = None) -> None:
        self.index, self.splits, self.tp, self.cut = index, splits, tp, cut

    def geometry(self, entry: TensorEntry) -> TpGeometry:
        """The cut of one tensor: `cut` (autotp_cut.TpCut) gives uneven sizes where AutoTP makes
        them, and the words that end a refusal; without it, equal parts."""
        dim = ((entry.attrs.get("parallel") or {}).get("tp") or {}).get("dim")
        name = param_name(entry)
        split = self.splits.get(name) if name is not None else None
        if self.cut is None:
            return for_full(split, tuple(entry.shape), dim, self.tp, entry.key)
        shares = self.cut.shares(entry, name, dim)
        return for_full(split, tuple(entry.shape), dim, self.tp, entry.key, shares, self.cut.reason)

    def uneven_shares(self) -> dict[str, tuple[int, ...]]:
        """parameter name -> each new rank's size along its split dimension, for the parameters
        cut unevenly (AutoTP's affine_map records them)."""
        out = {}
        for entry in self.index.tensors.values():
            name = param_name(entry)
            if entry.path and entry.path[0] == "model" and name is not None:
                geometry = self.geometry(entry)
                if geometry.shares is not None and len(geometry.shares) == 1:
                    out[name] = geometry.shares[0]
        return out

    def rank_index(self, t: int, dp: int) -> CheckpointIndex:
        """An index of rank t's slices under the usual keys, the full tensors under hidden ones."""
        index = self.index
        out = CheckpointIndex(format=index.format, root=index.root, world_size=dp)
        out.files.update(index.files)
        for key, entry in index.tensors.items():
            geometry = self.geometry(entry)
            if geometry.dim is None:
                out.add_tensor(entry)
                continue
            hidden = FULL + key
            out.add_tensor(TensorEntry(hidden, entry.dtype, entry.shape, list(entry.pieces)))
            full = tuple(entry.shape)
            flat = flat_concat(key, entry.dtype, geometry.split(hidden, full, t))
            out.add_tensor(
                TensorEntry(
                    key,
                    entry.dtype,
                    geometry.local_shape(full, t),
                    flat.pieces,
                    path=entry.path,
                    attrs={**entry.attrs, "virtual": True},
                )
            )
        for obj in index.objects.values():
            out.add_object(obj)
        out.step = index.step
        return out


def place(
    entry: TensorEntry, local: tuple[int, ...], full: tuple[int, ...], dim: int, blocks: list[TpBlock]
) -> list[Piece]:
    """One rank's pieces as pieces of the full tensor: flat ranges when only size-1 dimensions
    precede `dim`, else row-major boxes cut at block edges, read with the slice's strides."""
    item = itemsize(entry.dtype)
    out: list[Piece] = []
    for piece in entry.pieces:
        start, length = _flat_extent(entry, piece, local)
        if length == 0:
            continue
        if math.prod(full[:dim]) == 1:  # each block of a slice is one run of the full tensor
            out.extend(_flat_pieces(piece.location, start, length, math.prod(local[dim + 1 :]), item, blocks))
        else:
            out.extend(_box_pieces(piece.location, start, length, local, dim, item, blocks))
    return out


def _flat_pieces(loc: Location, start: int, length: int, inner: int, item: int, blocks: list[TpBlock]) -> list[Piece]:
    out = []
    for b in blocks:
        lo = max(start, b.local_start * inner)
        hi = min(start + length, (b.local_start + b.local_size) * inner)
        if hi > lo:
            out.append(
                Piece(
                    FlatRange(b.full_start * inner + lo - b.local_start * inner, hi - lo),
                    Location(loc.file, loc.offset + (lo - start) * item, (hi - lo) * item),
                )
            )
    return out


def _box_pieces(
    loc: Location, start: int, length: int, local: tuple[int, ...], dim: int, item: int, blocks: list[TpBlock]
) -> list[Piece]:
    out = []
    strides = row_major_strides(local)
    for box, _ in flat_to_boxes(FlatRange(start, length), local):
        for b in blocks:
            lo = max(box.offsets[dim], b.local_start)
            hi = min(box.offsets[dim] + box.sizes[dim], b.local_start + b.local_size)
            if hi <= lo:
                continue
            offsets = box.offsets[:dim] + (lo,) + box.offsets[dim + 1 :]
            sizes = box.sizes[:dim] + (hi - lo,) + box.sizes[dim + 1 :]
            first = sum(o * s for o, s in zip(offsets, strides))
            target = offsets[:dim] + (b.full_start + lo - b.local_start,) + offsets[dim + 1 :]
            byte = loc.offset + (first - start) * item
            if _contiguous(sizes, local):
                where = Location(loc.file, byte, math.prod(sizes) * item)
            else:
                where = Location(loc.file, byte, strided_span(sizes, strides) * item, stride=strides)
            out.append(Piece(Box(target, sizes), where))
    return out


def _flat_extent(entry: TensorEntry, piece: Piece, local: tuple[int, ...]) -> tuple[int, int]:
    """(start, length) of a piece as a run of its rank's slice (a flat range, or the whole tensor)."""
    loc = piece.location
    if loc.encoding != Encoding.RAW:
        raise UnsupportedError(f"{entry.key}: a {loc.encoding} piece cannot be placed in a tensor-parallel tensor yet")
    if isinstance(piece.region, FlatRange):
        return piece.region.start, piece.region.length
    if math.prod(local) == 0:  # an empty slice (AutoTP gives a rank beyond the head count none)
        return 0, 0
    if piece.region == Box.whole(local) and loc.stride is None:
        return 0, math.prod(local)
    raise UnsupportedError(f"{entry.key}: a strided or partial piece cannot be placed in a tensor-parallel tensor yet")


def _contiguous(sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A box whose elements are one run of the row-major tensor of `shape`."""
    for i, n in enumerate(sizes):
        if n > 1:
            return tuple(sizes[i + 1 :]) == tuple(shape[i + 1 :])
    return True
