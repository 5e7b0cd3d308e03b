"""Virtual tensors: logical tensors assembled from ranges of other tensors and zero padding.

A ZeRO partition is a concatenation of flat ranges of parameters plus padding; describing it
as a 1-D tensor whose pieces say "elements [a, b) of tensor K" (encoding "ref") or "zeros"
lets every writer stream it with the same Fetcher, from any source format, without ever
materialising a whole partition.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..torch_types import SmallTensor
from .dtypes import dtype_name
from .types import Box, Encoding, FlatRange, Location, Piece, TensorEntry

if TYPE_CHECKING:
    import torch

REF = Encoding.REF
ZEROS = Encoding.ZEROS
INLINE = Encoding.INLINE  # a small value built in memory (a converted optimizer step), in entry.attrs["value"]


@dataclass(frozen=True)
class Part:
    """`length` elements: from tensor `key` starting at flat element `start`, or zeros (key None)."""

    key: str | None
    start: int
    length: int


def flat_concat(key: str, dtype: str, parts: list[Part]) -> TensorEntry:
    """A 1-D virtual tensor made of `parts` in order."""
    pieces = []
    pos = 0
    for part in parts:
        length = part.length
        if length <= 0:
            continue
        loc = _ZERO_LOCATION if part.key is None else Location(part.key, part.start, length, REF)
        pieces.append(Piece(FlatRange(pos, length), loc))
        pos += length
    return TensorEntry(key, dtype, (pos,), pieces, attrs={"virtual": True})


def flat_slice(key: str, dtype: str, parts: list[Part], start: int, length: int) -> TensorEntry:
    """Elements [start, start+length) of the concatenation of `parts`, as a virtual tensor."""
    out: list[Part] = []
    pos = 0
    covered = 0
    end = start + length
    for part in parts:
        n = part.length
        lo, hi = (pos if pos > start else start), (pos + n if pos + n < end else end)
        if hi > lo:
            if lo == pos and hi - lo == n and (part.key is not None or part.start == 0):
                out.append(part)  # wholly inside: the same (immutable) part
            else:
                offset = lo - pos
                out.append(Part(part.key, part.start + offset if part.key is not None else 0, hi - lo))
            covered += hi - lo
        pos += n
    if covered < length:  # past the end of the parts: pad with zeros
        out.append(Part(None, 0, length - covered))
    return flat_concat(key, dtype, out)


# one zeros Location for every padding piece (immutable, equal to a new one)
_ZERO_LOCATION = Location("", 0, 0, ZEROS)


def inline_tensor(key: str, value: "torch.Tensor | SmallTensor", path: tuple | None = None) -> TensorEntry:
    """A small tensor that exists only in memory (e.g. AdamW's 0-d step made from DeepSpeed's
    int): a SmallTensor (written without torch) or a torch tensor."""
    if isinstance(value, SmallTensor):
        dtype, shape, nbytes = value.dtype, value.shape, len(value.data)
    else:
        value = value.detach().contiguous()
        dtype, shape, nbytes = dtype_name(value.dtype), tuple(value.shape), value.numel() * value.element_size()
    loc = Location("", 0, nbytes, INLINE)
    return TensorEntry(key, dtype, shape, [Piece(Box.whole(shape), loc)], path=path,
                       attrs={"virtual": True, "value": value})
