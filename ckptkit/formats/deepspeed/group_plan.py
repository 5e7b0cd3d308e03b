"""How each ZeRO (sub-)group is written at a new world size: its state keys (partitioned or
whole), its whole values, the masters' dtype and each rank's share of its flat buffer (virtual
slices of the per-parameter tensors, streamed when written)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ...errors import UnsupportedError, quote
from ...index.state_keys import model_key, state_key
from ...index.types import CheckpointIndex
from ...index.virtual import FlatTable, Part, flat_slice, flat_table
from ...optim_state import PARTITIONED, kind_of, refuse_unmappable
from ...runner.fetch import Fetcher
from ...runner.torch_archive import Archive
from ..torch_save.archive_writer import LazyTensor
from . import partition
from .info import ZeroGroup, ZeroInfo
from .templates import lazify
from .values import same_value


class StatePlanner:
    """How each optimizer state key of a (sub-)group is written: partitioned with the flat
    buffer (a virtual slice of the per-parameter tensors) or whole (the group's one value).

    The keys are the template's (the source rank's own state, or the one convert built), then any
    other key the index holds for these parameters, so nothing read is left out."""

    def __init__(self, index: CheckpointIndex, fetcher: Fetcher) -> None:
        self.index, self.fetcher = index, fetcher
        self.by_name: dict[str, list[str]] = {}  # param name -> its state keys, in index order
        by_name = self.by_name
        for entries in (index.tensors, index.objects):
            for e in entries.values():  # (a path (optim, state, name, key): 60k of 80k entries at 20k params)
                path = e.path
                if path and len(path) == 4 and path[0] == "optim" and path[1] == "state":
                    name = str(path[2])
                    keys = by_name.get(name)
                    if keys is None:
                        by_name[name] = [path[3]]
                    else:
                        keys.append(path[3])

    def keys(self, template: Any, names: list[str]) -> list[Any]:
        keys = list(template) if isinstance(template, dict) else []
        for name in names:
            keys += [k for k in self.by_name.get(name, []) if k not in keys]
        return keys

    def plan(self, keys: list[Any], params: list[tuple[str, tuple[int, ...]]], where: str) -> dict[Any, str | None]:
        """key -> the dtype of a partitioned state, None for a whole one."""
        out: dict[Any, str | None] = {}
        for key in keys:
            refuse_unmappable(str(key), where)
            entries = [(self.index.tensors.get(state_key(n, key)), s) for n, s in params]
            kinds = [e is not None and kind_of(str(key), e.shape, s) == PARTITIONED for e, s in entries]
            if params and all(kinds):
                dtypes = {e.dtype for e, _ in entries}
                if len(dtypes) > 1:
                    raise UnsupportedError(
                        f"{where}: optimizer state {quote(str(key))} has dtypes "
                        f"{sorted(dtypes)} across the parameters of one partition"
                    )
                out[key] = dtypes.pop()
            elif any(kinds):
                odd = [n for (n, _), k in zip(params, kinds) if not k][:3]
                raise UnsupportedError(
                    f"{where}: optimizer state {quote(str(key))} is shaped like its parameter "
                    f"for some parameters but not for {odd}; they cannot share one ZeRO "
                    f"partition"
                )
            else:
                out[key] = None
        return out

    def whole(self, key: Any, names: list[str], template: Any, where: str) -> Any:
        """The one value of a whole state for these parameters (they must agree), else the template's."""
        values: list[Any] = []
        for n in names:
            k = state_key(n, key)
            if k in self.index.objects:
                value = self.index.objects[k].data
            elif k in self.index.tensors:
                value = self.fetcher.fetch(self.index.tensors[k])
            else:
                continue
            if not any(same_value(value, v) for v in values):
                values.append(value)
        if len(values) > 1:
            raise UnsupportedError(
                f"{where}: parameters {names[:3]}... have different values of optimizer state "
                f"{quote(str(key))} ({quote(', '.join(sorted(map(repr, values))))}); they "
                f"cannot share one ZeRO partition"
            )
        return copy.deepcopy(values[0]) if values else template


def virtual(key: str, dtype: str, parts: list[Part], start: int, length: int) -> LazyTensor:
    """Elements [start, start+length) of the concatenated parts, streamed when written."""
    return LazyTensor(flat_slice(key, dtype, parts, start, length))


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """How one (sub-)group is written at the new world size: its state keys, whole values and
    each rank's share of its flat buffer."""

    group: ZeroGroup
    keys: dict[Any, str | None]  # state key -> dtype of a partitioned one, None for a whole one
    whole: dict[Any, Any]  # whole state key -> the group's one value
    master_dtype: str
    has_state: bool  # the optimizer holds state for it (else it is left out)
    shares: list[partition.RankShare]
    # rank -> its slots as table columns (names, starts, lengths, positions, end), shared by the
    # rank's partitions; (names, state key or None) -> the keys the table refers to, shared by the
    # ranks whose names are the same (stage 3's are alike) (_table)
    _rank_columns: dict[int, tuple] = field(default_factory=dict, compare=False, repr=False)
    _refs: dict[tuple[tuple[str, ...], Any], list[str]] = field(default_factory=dict, compare=False, repr=False)

    def masters(self, rank: int) -> LazyTensor:
        """This rank's flat partition of the fp32 masters."""
        share = self.shares[rank]
        return _table_or_parts(
            f"fp32.{self.group.index}.{rank}",
            self.master_dtype,
            self._table(rank, None, share.own),
            lambda: _parts(share, model_key),
            share.own,
        )

    def state(self, rank: int) -> dict[Any, Any]:
        """This rank's optimizer state of the group: flat partitions and whole values."""
        share = self.shares[rank]
        return {
            key: (
                _table_or_parts(
                    f"{key}.{self.group.index}.{rank}",
                    dtype,
                    self._table(rank, key, share.size),
                    lambda key=key: _parts(share, lambda name: state_key(name, key)),
                    share.size,
                )
                if dtype is not None
                else copy.deepcopy(self.whole[key])
            )
            for key, dtype in self.keys.items()
        }

    def _table(self, rank: int, key: Any, numel: int) -> FlatTable | None:
        """Rank's partition of `numel` elements of the masters (key None) or of state `key`, as a
        flat table of its slots (a part per parameter, zeros between), or None where a slot ends
        past `numel` (then its parts, sliced)."""
        cols = self._rank_columns.get(rank)
        if cols is None:
            import numpy as np  # here: a plan that writes no partition needs none

            slots = self.shares[rank].slots
            names, starts, lengths, positions = (tuple(c) for c in zip(*slots)) if slots else ((), (), (), ())
            end = positions[-1] + lengths[-1] if slots else 0
            cols = self._rank_columns[rank] = (
                names,
                *(np.array(c, dtype=np.int64) for c in (starts, lengths, positions)),
                end,
            )
        names, starts, lengths, positions, end = cols
        if end > numel:
            return None
        refs = self._refs.get((names, key))  # the ranks' names are alike in stage 3: built once
        if refs is None:
            refs = self._refs[(names, key)] = (
                [model_key(n) for n in names] if key is None else [state_key(n, key) for n in names]
            )
        return FlatTable(refs, starts, lengths, positions, numel)


def _table_or_parts(
    key: str, dtype: str, table: FlatTable | None, parts: Callable[[], list[Part]], length: int
) -> LazyTensor:
    """A partition as its flat table, else as its parts sliced to `length`."""
    if table is not None:
        return LazyTensor(flat_table(key, dtype, table))
    return virtual(key, dtype, parts(), 0, length)


def _parts(share: partition.RankShare, key_of: Callable[[str], str]) -> list[Part]:
    """A rank's flat tensor as parts of per-parameter tensors, zeros where it is padded."""
    parts, position = [], 0
    for name, start, length, at in share.slots:
        if at > position:
            parts.append(Part(None, 0, at - position))
        parts.append(Part(key_of(name), start, length))
        position = at + length
    return parts


def target_groups(info: ZeroInfo, world: int, sub_group_size: int | None) -> list[ZeroGroup]:
    """The (sub-)groups at the new world size: stage 1/2 keeps the groups; stage 3 splits each
    param group into sub-groups the way DeepSpeed does at that size."""
    if info.stage < 3:
        return info.groups
    by_group: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for grp in info.groups:
        by_group.setdefault(grp.param_group, []).extend(grp.params)
    groups: list[ZeroGroup] = []
    for g in range(info.param_group_count):
        shapes = dict(by_group.get(g, []))
        for sub in partition.stage3_sub_groups(
            [(n, math.prod(s)) for n, s in by_group.get(g, [])], world, sub_group_size
        ):
            groups.append(ZeroGroup(index=len(groups), param_group=g, params=tuple((n, shapes[n]) for n, _ in sub)))
    return groups


def state_templates(stage: int, template_state: Any, groups: list[ZeroGroup]) -> list[dict | None]:
    """Each group's state in the template, None where the optimizer held none. Stage 3's
    sub-groups change with the world size: each gets every key any source sub-group had."""
    if not isinstance(template_state, dict):
        return [None] * len(groups)
    if stage < 3:
        return [template_state.get(grp.index) for grp in groups]
    keys: dict = {}
    for sub_state in template_state.values():
        if isinstance(sub_state, dict):
            keys.update({k: v for k, v in sub_state.items() if k not in keys})
    return [keys if template_state else None] * len(groups)


def plan_group(
    index: CheckpointIndex,
    states: StatePlanner,
    stage: int,
    group: ZeroGroup,
    template: dict | None,
    oarchive: Archive | None,
    where: str,
    world: int,
) -> GroupPlan:
    names = group.names
    keys = states.plan(states.keys(template, names), group.params, where)
    whole = {
        key: states.whole(key, names, lazify((template or {}).get(key), oarchive, {}), where)
        for key, dtype in keys.items()
        if dtype is None
    }
    shares = partition.rank_shares(stage, [(n, math.prod(s)) for n, s in group.params], group.paddings, world)
    return GroupPlan(
        group=group,
        keys=keys,
        whole=whole,
        master_dtype=master_dtype(index, names),
        has_state=template is not None or bool(keys),
        shares=shares,
    )


def master_dtype(index: CheckpointIndex, names: list[str]) -> str:
    """The dtype of a flat buffer of fp32 masters (DeepSpeed's are float32), the same for all."""
    dtypes = {index.tensors[model_key(n)].dtype for n in names}
    if len(dtypes) > 1:
        raise UnsupportedError(
            f"the master weights of one ZeRO partition have dtypes {sorted(dtypes)} "
            f"(parameters {names[:3]}...); they cannot share a flat buffer"
        )
    return dtypes.pop() if dtypes else "float32"
