"""The optimizer state of one ZeRO (sub-)group, read rank by rank and checked for consistency.

Each key is classified by its shape (ckptkit.optim_state): partitioned with the flat buffer
(exp_avg, momentum_buffer, ...) or kept whole for the group (a step), which then must be one
value on every rank and is given to each of the group's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import FormatError, UnsupportedError, quote
from ...index.state_keys import state_key, state_path
from ...index.types import CheckpointIndex, Location, ObjectEntry
from ...optim_state import PARTITIONED, WHOLE, kind_of, refuse_unmappable
from ...safeload import TensorRef
from ...runner.torch_archive import Archive, tensor_location
from ..torch_save.reader import materialize
from .entries import refuse_strided
from .values import same_value, value_weight

# A state kept whole is copied to every parameter of its group, and every command then walks it
# once per parameter: its values (strings, bytes and tensor data one per 64 bytes) times the
# parameters are held to this. torch's step is one value; a 2M-element list over 5 parameters
# kept `inspect` busy for minutes.
MAX_WHOLE_FANOUT = 1_000_000


@dataclass(kw_only=True)
class GroupState:
    """Filled rank by rank (`read`), then added to the index (`add_whole`)."""

    where: str  # "group 0" / "sub-group 2"
    params: int = 1  # parameters of the group: each gets the whole values
    kinds: dict[str, str] = field(default_factory=dict)  # key -> PARTITIONED / WHOLE, in order
    dtypes: dict[str, str] = field(default_factory=dict)  # partitioned key -> dtype
    whole: dict[str, tuple[int, Any]] = field(default_factory=dict)  # whole key -> (first rank read, value)
    keys_rank: int | None = None

    def read(self, arch: Archive, rank: int, gstate: Any, flat: tuple[int, ...]) -> dict[str, Location]:
        """Classify every key of this rank's state (`flat`: the flat partition lengths a
        partitioned state may have); the locations of the partitioned ones."""
        if gstate is None:
            gstate = {}
        if not isinstance(gstate, dict):
            raise FormatError(
                f"{arch.label}: optimizer state of {self.where} is a "
                f"{type(gstate).__name__}, expected a dict of per-key values"
            )
        if self.keys_rank is not None and set(gstate) != set(self.kinds):
            raise FormatError(
                f"{arch.label}: optimizer state of {self.where} has keys "
                f"{quote(str(sorted(map(str, gstate))))}, rank {self.keys_rank}'s has "
                f"{quote(str(sorted(map(str, self.kinds))))}; every rank's must match"
            )
        locs: dict[str, Location] = {}
        named: dict[str, Any] = {}
        for key, value in gstate.items():
            if named.setdefault(str(key), key) is not key:  # 1 and "1": one index entry, one value lost
                raise FormatError(
                    f"{arch.label}: optimizer state of {self.where} has keys "
                    f"{quote(repr(named[str(key)]))} and {quote(repr(key))}, which name the same "
                    f"state optim.state.<parameter>.{quote(str(key))}; refused, as one would be lost"
                )
            refuse_unmappable(key, f"{arch.label}: {self.where}")
            shape = tuple(value.size) if isinstance(value, TensorRef) else None
            kind = WHOLE
            if shape is not None and any(kind_of(str(key), shape, (n,)) == PARTITIONED for n in flat):
                kind = PARTITIONED
            if self.kinds.setdefault(key, kind) != kind:
                raise FormatError(
                    f"{arch.label}: optimizer state {quote(str(key))} of {self.where} has "
                    f"{list(shape or ())} elements, not those of rank {self.keys_rank}'s"
                )
            if kind == PARTITIONED:
                locs[key] = self._partitioned(arch, key, value)
            else:
                self._whole(arch, rank, key, value)
        if self.keys_rank is None:
            self.keys_rank = rank
        return locs

    def _partitioned(self, arch: Archive, key: Any, value: TensorRef) -> Location:
        """Where this rank's flat partition of `key` is; its dtype the same on every rank."""
        dtype, loc = tensor_location(arch, value, f"optimizer state {key!r} of {self.where}")
        refuse_strided(arch, loc, f"optimizer state {quote(str(key))} of {self.where}")
        if self.dtypes.setdefault(key, dtype) != dtype:
            raise FormatError(
                f"{arch.label}: optimizer state {quote(str(key))} of {self.where} is "
                f"{quote(dtype)}, rank {self.keys_rank}'s is {quote(self.dtypes[key])}"
            )
        return loc

    def _whole(self, arch: Archive, rank: int, key: Any, value: Any) -> None:
        """One value for the group: the first rank's, every other rank's checked equal to it
        (a value that differs between ranks has no single owner and would be lost)."""
        value = materialize(value, arch)
        if key not in self.whole:
            limit = MAX_WHOLE_FANOUT // max(1, self.params)
            if value_weight(value, limit) > limit:  # every command walks it once per parameter
                raise UnsupportedError(
                    f"{arch.label}: optimizer state {quote(str(key))} of {self.where} is not partitioned with the "
                    f"parameters and too large to keep for each of its {self.params} parameters (over {limit:,} "
                    f"values, {MAX_WHOLE_FANOUT:,} shared by them); a value kept per parameter is a step or "
                    f"another small one"
                )
            self.whole[key] = (rank, value)
        elif not same_value(self.whole[key][1], value):
            first, kept = self.whole[key]
            raise UnsupportedError(
                f"{arch.label}: optimizer state {quote(str(key))} of {self.where} is "
                f"{quote(repr(value))} here and {quote(repr(kept))} on rank {first}: a value "
                f"that is not partitioned with the parameters must be the same on every "
                f"rank to be kept per parameter"
            )

    def partitioned(self) -> list[str]:
        return [k for k, kind in self.kinds.items() if kind == PARTITIONED]

    def add_whole(self, index: CheckpointIndex, names: list[str]) -> None:
        """The group's whole values, one entry per parameter (the same value for each)."""
        for key, kind in self.kinds.items():
            if kind == WHOLE:
                for name in names:
                    index.add_object(ObjectEntry(state_key(name, key), self.whole[key][1], path=state_path(name, key)))
