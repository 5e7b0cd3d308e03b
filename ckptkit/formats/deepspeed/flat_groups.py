"""The flat buffers of a ZeRO checkpoint, read group by group for stages 1, 2 and 3 alike.

Each rank's optim-states file holds, per (sub-)group, a flat fp32 partition of the masters and
one flat partition per partitioned optimizer state. partition.py says which elements of which
parameter each rank's partition holds; here those become `FlatRange` pieces of `model.<name>`
and `optim.state.<name>.<key>`, one tensor per parameter shaped like it.

A reader told the optimizer's per-parameter state is not wanted (consolidate writing the weights
alone) still reads and checks every rank's optimizer state group by group, but indexes only the
masters: the per-parameter state entries it leaves out are counted in
index.metadata[UNINDEXED_OPTIMIZER], so what is not written is still said.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from ...errors import FormatError, quote
from ...index import problems
from ...index.dtypes import is_floating, itemsize
from ...index.state_keys import model_key, model_path, state_key, state_path
from ...index.types import (
    CheckpointIndex,
    FlatRange,
    Location,
    Piece,
    TensorEntry,
    unchecked_flat_range,
    unchecked_location,
    unchecked_piece,
)
from ...runner.torch_archive import Archive
from ..protocols import UNINDEXED_OPTIMIZER
from . import partition
from .entries import entry, refuse_strided, tensor_of
from .files import ZeroFiles
from .group_state import GroupState
from .info import StageNames, ZeroGroup


@dataclass(frozen=True, kw_only=True)
class RankFiles:
    """The optim-states files as opened: rank -> structure (a rank verify found unreadable is absent)."""

    files: ZeroFiles
    archives: dict[str, Archive]
    optim: dict[int, Any]
    world_size: int

    def archive(self, rank: int) -> Archive:
        return self.archives[self.files.prefix + self.files.optim_files[rank]]


@dataclass(kw_only=True)
class _FlatPieces:
    """Per-parameter pieces of every flat tensor read so far, keyed by (name, state key or None
    for the master); a parameter's pieces share one dtype."""

    pieces: dict[tuple[str, Any], list[Piece]] = field(default_factory=dict)
    dtypes: dict[tuple[str, Any], str] = field(default_factory=dict)
    # state key (None: the masters) -> every dtype `dtypes` holds for it: while a key has had one
    # dtype only, a rank's tensor of that dtype cannot disagree with any parameter's (add)
    _kinds: dict[Any, set[str]] = field(default_factory=dict)

    def add(
        self, arch: Archive, share: partition.RankShare, what: Any, dtype: str, loc: Location, ranges: list[FlatRange]
    ) -> None:
        """Cut one rank's flat tensor at `loc` (`what`: a state key, None for the masters);
        `ranges`: each slot's FlatRange, shared by the rank's flat tensors (they are immutable)."""
        if not share.slots:
            return
        item = itemsize(dtype)
        base = loc.offset
        names, _, lengths, positions = zip(*share.slots)
        keys = list(zip(names, repeat(what)))
        kinds = self._kinds.setdefault(what, set())
        if kinds and kinds != {dtype}:  # some parameter may hold another dtype: each checked, in order
            self._check_dtypes(arch, keys, dtype)
        self.dtypes.update(zip(keys, repeat(dtype)))  # (every key already there holds `dtype`)
        kinds.add(dtype)
        # Piece(region, Location(file, offset, length)) without the dataclasses' checks (types.py says why)
        made = map(
            unchecked_piece,
            ranges,
            map(
                unchecked_location, repeat(loc.file), [base + p * item for p in positions], [n * item for n in lengths]
            ),
        )
        pieces = self.pieces
        for k, piece in zip(keys, made):  # per parameter and rank: kept lean
            got = pieces.get(k)
            if got is None:
                pieces[k] = [piece]
            else:
                got.append(piece)

    def _check_dtypes(self, arch: Archive, keys: list[tuple[str, Any]], dtype: str) -> None:
        """Refuse the first parameter whose tensor another rank gave another dtype."""
        dtypes = self.dtypes
        for k in keys:
            if dtypes.get(k, dtype) != dtype:
                name, what = k
                key = model_key(name) if what is None else state_key(name, what)
                raise FormatError(f"{arch.label}: {key} is {quote(dtype)} here, {quote(dtypes[k])} on another rank")

    def ensure(self, name: str, what: Any, dtype: str) -> None:
        """A parameter's tensor of `what` exists (with no pieces, if no rank held any), of `dtype`
        unless a rank's said otherwise."""
        if self.dtypes.setdefault((name, what), dtype) == dtype:
            self._kinds.setdefault(what, set()).add(dtype)

    def add_tensors(self, index: CheckpointIndex, shapes: dict[str, tuple[int, ...]]) -> None:
        """The masters (`model.<name>`), then every partitioned state key (`optim.state.<name>.<key>`),
        one TensorEntry per parameter shaped like it; a zero-size parameter's have no pieces."""
        for name, shape in shapes.items():
            index.add_tensor(
                TensorEntry(
                    model_key(name),
                    self.dtypes.get((name, None), "float32"),
                    shape,
                    self.pieces.get((name, None), []),
                    path=model_path(name),
                    attrs={"ds_role": "fp32_master"},
                )
            )
        for (name, what), dtype in self.dtypes.items():
            if what is not None:
                index.add_tensor(
                    TensorEntry(
                        state_key(name, what),
                        dtype,
                        shapes[name],
                        self.pieces.get((name, what), []),
                        path=state_path(name, what),
                    )
                )


def read_flat_groups(
    index: CheckpointIndex,
    stage: int,
    ranks: RankFiles,
    groups: list[ZeroGroup],
    names: StageNames,
    *,
    optimizer: bool = True,
) -> None:
    """Every group's masters and optimizer state into `index`; `optimizer` False: the optimizer
    state is read and checked the same, but its per-parameter entries are only counted
    (index.metadata[UNINDEXED_OPTIMIZER]): cutting 2 states x 20k parameters into pieces costs
    more than the masters a consolidate writes."""
    flats = _FlatPieces()
    shapes: dict[str, tuple[int, ...]] = {}
    left_out = [0, 0]  # (tensors, values) not indexed
    for group in groups:
        shapes.update(group.params)
        _read_group(index, stage, ranks, group, names, flats, left_out if not optimizer else None)
    flats.add_tensors(index, shapes)
    if not optimizer:
        index.metadata[UNINDEXED_OPTIMIZER] = {"tensors": left_out[0], "values": left_out[1]}


def _read_group(
    index: CheckpointIndex,
    stage: int,
    ranks: RankFiles,
    group: ZeroGroup,
    names: StageNames,
    flats: _FlatPieces,
    left_out: list[int] | None,
) -> None:
    """One (sub-)group, rank by rank; `left_out` (tensors, values) counts the optimizer state
    entries not indexed (None: every one is)."""
    numels = [(name, math.prod(shape)) for name, shape in group.params]
    state = GroupState(where=f"{names.group} {group.index}", params=len(group.params))
    damaged: list[str] = []
    for rank, share in enumerate(partition.rank_shares(stage, numels, group.paddings, ranks.world_size)):
        if rank not in ranks.optim:  # its file was missing or unreadable (verify listed it)
            damaged += [slot.name for slot in share.slots]
            continue
        arch = ranks.archive(rank)
        osd = ranks.optim[rank]["optimizer_state_dict"]
        mdtype, loc, length = _masters(arch, osd, names, group.index, share, ranks.world_size)
        ranges = [unchecked_flat_range(slot.start, slot.length) for slot in share.slots]
        flats.add(arch, share, None, mdtype, loc, ranges)
        values = entry(entry(osd, names.optimizer, arch.label), "state", arch.label)
        if not isinstance(values, dict):
            raise FormatError(f"{arch.label}: optimizer state is a {type(values).__name__}, expected a dict")
        locs = state.read(arch, rank, values.get(group.index), (share.size, length))
        if left_out is not None:
            continue
        for key, sloc in locs.items():
            flats.add(arch, share, key, state.dtypes[key], sloc, ranges)
    if left_out is not None:
        _tolerate_damaged(damaged, [])
        left_out[0] += len(group.params) * len(state.partitioned())
        left_out[1] += len(group.params) * (len(state.kinds) - len(state.partitioned()))
        return
    _tolerate_damaged(damaged, state.partitioned())
    state.add_whole(index, group.names)
    for key in state.partitioned():  # a parameter with no elements still has its (empty) state
        for name in group.names:
            flats.ensure(name, key, state.dtypes[key])


def _tolerate_damaged(names: list[str], keys: list[str]) -> None:
    """Tensors of these parameters lack the pieces of a rank verify already reported."""
    problems.tolerate_keys([k for n in names for k in (model_key(n), *(state_key(n, key) for key in keys))])


def _masters(
    arch: Archive, osd: dict, names: StageNames, i: int, share: partition.RankShare, world: int
) -> tuple[str, Location, int]:
    """(dtype, location, length) of this rank's fp32 master partition of (sub-)group `i`: its
    length is the share's (with or without the end padding) and its dtype a floating one
    (DeepSpeed keeps fp32 masters; another float is read as what it is)."""
    what = names.group
    tensors = entry(osd, names.masters, arch.label)
    if not isinstance(tensors, list) or i >= len(tensors):
        raise FormatError(f"{arch.label}: {names.masters} has no {what} {i}")
    dtype, loc, shape = tensor_of(arch, tensors[i], f"fp32 partition of {what} {i}")
    if len(shape) != 1 or shape[0] not in (share.own, share.size):
        raise FormatError(
            f"{arch.label}: fp32 partition of {what} {i} has {list(shape)} elements, "
            f"the layout of {world} ranks needs {share.own}"
        )
    if not is_floating(dtype):
        raise FormatError(
            f"{arch.label}: fp32 partition of {what} {i} is {quote(dtype)}, expected a "
            f"floating-point tensor (the optimizer's master weights)"
        )
    refuse_strided(arch, loc, f"fp32 partition of {what} {i}")
    return dtype, loc, shape[0]
