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
    import numpy as np
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
    return TensorEntry(
        key, dtype, shape, [Piece(Box.whole(shape), loc)], path=path, attrs={"virtual": True, "value": value}
    )


class FlatTable:
    """A 1-D virtual tensor of `numel` elements as a table, not a piece per part: part i is
    elements [starts[i], starts[i]+lengths[i]) of the flattening of tensor `refs[i]`, placed at
    `positions[i]`; every element no part covers is zero padding. A ZeRO partition at a new world
    size is 20k such parts for 20k parameters: three int64 arrays and a list of keys instead of
    a Part, a Piece, a FlatRange and a Location each (runner/flat_table.py plans its byte ranges
    from the arrays). Parts are non-empty, in order and apart (checked when made)."""

    __slots__ = ("refs", "starts", "lengths", "positions", "numel")

    def __init__(
        self, refs: list[str], starts: "np.ndarray", lengths: "np.ndarray", positions: "np.ndarray", numel: int
    ) -> None:
        import numpy as np

        self.refs, self.numel = refs, numel
        self.starts, self.lengths, self.positions = (
            np.asarray(a, dtype=np.int64) for a in (starts, lengths, positions)
        )
        n = len(refs)
        if not (len(self.starts) == len(self.lengths) == len(self.positions) == n):
            raise ValueError("a flat table's columns differ in length")
        if n and (
            bool((self.lengths <= 0).any())
            or bool((self.starts < 0).any())
            or int(self.positions[0]) < 0
            or bool((self.positions[1:] < self.positions[:-1] + self.lengths[:-1]).any())
            or int(self.positions[-1] + self.lengths[-1]) > numel
        ):
            raise ValueError("a flat table's parts must be non-empty, in order, apart and inside the tensor")

    def parts(self) -> list[Part]:
        """The same tensor as Part lists describe it (zeros for every gap, then the end's)."""
        out: list[Part] = []
        pos = 0
        for ref, start, length, at in zip(
            self.refs, self.starts.tolist(), self.lengths.tolist(), self.positions.tolist()
        ):
            if at > pos:
                out.append(Part(None, 0, at - pos))
            out.append(Part(ref, start, length))
            pos = at + length
        if pos < self.numel:
            out.append(Part(None, 0, self.numel - pos))
        return out


class TableEntry(TensorEntry):
    """The TensorEntry of a FlatTable (`table`): its pieces (flat_concat's, for the table's parts)
    are made only when something asks for them; the read planner plans its byte ranges from the
    table itself (runner/flat_table.py)."""

    def __init__(self, key: str, dtype: str, table: FlatTable) -> None:  # not a dataclass __init__: lazy pieces
        self.key, self.dtype, self.shape, self.path = key, dtype, (table.numel,), None
        self.attrs = {"virtual": True}
        self.table = table
        self._pieces: list[Piece] | None = None

    @property  # type: ignore[override]
    def pieces(self) -> list[Piece]:
        if self._pieces is None:
            self._pieces = flat_concat(self.key, self.dtype, self.table.parts()).pieces
        return self._pieces

    @pieces.setter
    def pieces(self, value: list[Piece]) -> None:
        self._pieces = value


def flat_table(key: str, dtype: str, table: FlatTable) -> TableEntry:
    """A 1-D virtual tensor described by `table` (see FlatTable)."""
    return TableEntry(key, dtype, table)
