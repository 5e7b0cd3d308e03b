"""Write a native (rigid, not universal) DeepSpeed ZeRO checkpoint for a new world size.

Same stage and precision as the source. Everything DeepSpeed's loader and its own tools read is
recomputed for M ranks: partition sizes and paddings, fp32 partitions and every optimizer state
partitioned with them, whatever the optimizer (exp_avg, momentum_buffer, sum, square_avg...: as
virtual slices of the per-parameter tensors, streamed), stage-3 sub-groups and frozen fragments,
param_shapes, partition_count, param_slice_mappings, group_paddings, dp_world_size. Everything
else (scheduler, loss scaler, client state, config) is carried over unchanged, the DeepSpeed
classes re-emitted as themselves; optimizer state kept whole (an int step, torch's 0-d step
tensor) is each group's one value, of the same type and dtype.
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import Any

from ...errors import FormatError, UnsupportedError, quote
from ...index.types import Box, CheckpointIndex, Piece, TensorEntry
from ...index.virtual import Part, flat_slice
from ...lazy_torch import is_tensor
from ...optim_state import PARTITIONED, kind_of, refuse_unmappable
from ...progress import NullProgress, Progress
from ...repickle import stand_in
from ...runner.executor import run_jobs
from ...runner.fetch import Fetcher
from ...safeload import TensorRef
from ...storage.output import OutputDir
from ...storage.source import Source
from ...torch_types import Size
from ..torch_save.archive import Archive, tensor_location
from ..torch_save.archive_writer import LazyTensor, write_archive
from . import partition, standins
from .reader import ZeroInfo

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
HELPER_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def _lazify(value: Any, archive: Archive, cache: dict) -> Any:
    """Replace TensorRefs of a template structure by LazyTensors reading the same bytes."""
    if isinstance(value, TensorRef):
        if value not in cache:
            dtype, loc = tensor_location(archive, value, "tensor")
            shape = tuple(value.size)
            entry = TensorEntry(f"{archive.file}:{value.storage.key}", dtype, shape, [Piece(Box.whole(shape), loc)])
            cache[value] = LazyTensor(entry)
        return cache[value]
    if isinstance(value, OrderedDict):
        return OrderedDict((k, _lazify(v, archive, cache)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _lazify(v, archive, cache) for k, v in value.items()}
    if isinstance(value, list):
        return [_lazify(v, archive, cache) for v in value]
    if type(value) is tuple:
        return tuple(_lazify(v, archive, cache) for v in value)
    return value


def _config(index: CheckpointIndex) -> dict:
    obj = index.objects.get("ds.ds_config")
    return obj.data if obj is not None and isinstance(obj.data, dict) else {}


class _States:
    """How each optimizer state key of a (sub-)group is written: partitioned with the flat
    buffer (a virtual slice of the per-parameter tensors) or whole (the group's one value).

    The keys are the template's (the source rank's own state, or the one convert built), then any
    other key the index holds for these parameters, so nothing read is left out."""

    def __init__(self, index: CheckpointIndex, fetcher: Fetcher) -> None:
        self.index, self.fetcher = index, fetcher
        self.by_name: dict[str, list[str]] = {}   # param name -> its state keys, in index order
        for key, e in list(index.tensors.items()) + list(index.objects.items()):
            path = e.path if e.path and len(e.path) == 4 and tuple(e.path[:2]) == ("optim", "state") else None
            if path is not None:
                self.by_name.setdefault(str(path[2]), []).append(path[3])

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
            entries = [(self.index.tensors.get(_state_key(n, key)), s) for n, s in params]
            kinds = [e is not None and kind_of(str(key), e.shape, s) == PARTITIONED for e, s in entries]
            if params and all(kinds):
                dtypes = {e.dtype for e, _ in entries}
                if len(dtypes) > 1:
                    raise UnsupportedError(f"{where}: optimizer state {quote(str(key))} has dtypes "
                                           f"{sorted(dtypes)} across the parameters of one partition")
                out[key] = dtypes.pop()
            elif any(kinds):
                odd = [n for (n, _), k in zip(params, kinds) if not k][:3]
                raise UnsupportedError(f"{where}: optimizer state {quote(str(key))} is shaped like its parameter "
                                       f"for some parameters but not for {odd}; they cannot share one ZeRO "
                                       f"partition")
            else:
                out[key] = None
        return out

    def whole(self, key: Any, names: list[str], template: Any, where: str) -> Any:
        """The one value of a whole state for these parameters (they must agree), else the template's."""
        values: list[Any] = []
        for n in names:
            k = _state_key(n, key)
            if k in self.index.objects:
                value = self.index.objects[k].data
            elif k in self.index.tensors:
                value = self.fetcher.fetch(self.index.tensors[k])
            else:
                continue
            if not any(_same(value, v) for v in values):
                values.append(value)
        if len(values) > 1:
            raise UnsupportedError(f"{where}: parameters {names[:3]}... have different values of optimizer state "
                                   f"{quote(str(key))} ({quote(', '.join(sorted(map(repr, values))))}); they "
                                   f"cannot share one ZeRO partition")
        return copy.deepcopy(values[0]) if values else template


def _state_key(name: str, key: Any) -> str:
    return f"optim.state.{name}.{key}"


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same type (a step as an int, a SmallTensor, a torch tensor)."""
    if type(a) is not type(b):
        return False
    if is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values of foreign types that cannot compare: different
        return False


def _virtual(key: str, dtype: str, parts: list[Part], start: int, length: int) -> LazyTensor:
    """Elements [start, start+length) of the concatenated parts, streamed when written."""
    return LazyTensor(flat_slice(key, dtype, parts, start, length))


def write_zero(out: OutputDir, index: CheckpointIndex, source: Source, world_size: int, *,
               slab_bytes: int, workers: int = 4, progress: Progress | None = None) -> list[str]:
    """Reshard: the source's own files, recomputed for `world_size` ranks."""
    info: ZeroInfo = index.native
    if not isinstance(info, ZeroInfo):
        raise FormatError("write_zero needs a DeepSpeed checkpoint read by ckptkit")
    config = _config(index)
    zero_cfg = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
    if isinstance(zero_cfg, dict) and zero_cfg.get("round_robin_gradients"):
        raise UnsupportedError("round_robin_gradients reorders ZeRO partitions by world size; resharding "
                               "such checkpoints is not supported yet")
    tag = info.layout.tag or (f"global_step{index.step}" if index.step is not None else "global_step0")
    sub_group_size = zero_cfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE) if isinstance(zero_cfg, dict) else None
    written = write_zero_files(out, index, source, info, world_size, tag,
                               int(sub_group_size) if sub_group_size is not None else None,
                               slab_bytes=slab_bytes, workers=workers, progress=progress)
    for script in HELPER_SCRIPTS:  # DeepSpeed copies its recovery scripts next to every save
        if info.layout.tag is not None and source.exists(script) and not source.isdir(script):
            out.write_bytes(script, source.read(script, 0, source.size(script)))
            written.append(script)
    return written


def write_zero_files(out: OutputDir, index: CheckpointIndex, source: Source, info: ZeroInfo, world_size: int,
                     tag: str, sub_group_size: int | None, *, slab_bytes: int, workers: int = 4,
                     progress: Progress | None = None) -> list[str]:
    """`latest` and the tag's model/optim files for `world_size` ranks, from `info`'s templates
    (a source checkpoint's own structures, or ones convert built from a DeepSpeed config)."""
    progress = progress or NullProgress()
    fetcher = Fetcher(source, index=index)
    files: dict[str, Any] = {}  # relative name -> structure
    states = _States(index, fetcher)
    if info.stage < 3:
        _stage12(index, info, world_size, tag, files, states)
    else:
        _stage3(index, info, world_size, tag, files, sub_group_size, states)
    jobs = [(lambda n=n, s=s: write_archive(out, n, s, fetcher, slab_bytes=slab_bytes, progress=progress))
            for n, s in files.items()]
    run_jobs(jobs, workers, group=out.group, weights=[structure_bytes(s) for s in files.values()])
    out.write_bytes("latest", tag.encode())
    return ["latest", *files]


def structure_bytes(value: Any) -> int:
    """Tensor bytes a file structure will hold (how a distributed run balances files)."""
    if isinstance(value, LazyTensor):
        return value.entry.nbytes
    if isinstance(value, dict):
        return sum(structure_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(structure_bytes(v) for v in value)
    return 0


def _optim_name(info: ZeroInfo, rank: int) -> str:
    return f"{'bf16_' if info.layout.bf16_prefix else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _template(info: ZeroInfo, kind: str, rank: int) -> tuple[Any, Archive]:
    files = info.layout.model_files if kind == "model" else info.layout.optim_files
    rel = info.layout.prefix + files[rank]
    states = info.model_states if kind == "model" else info.optim_states
    return states[rank], info.archives.get(rel)  # no archive: a template convert built


def _stage12(index: CheckpointIndex, info: ZeroInfo, world: int, tag: str, files: dict, states: _States) -> None:
    m0, marchive = _template(info, "model", min(info.layout.model_files))
    model = _lazify(m0, marchive, {})
    model["dp_world_size"] = world
    files[f"{tag}/mp_rank_00_model_states.pt"] = model

    o0, oarchive = _template(info, "optim", 0)
    osd_t = o0["optimizer_state_dict"]
    base_t = osd_t["base_optimizer_state"]
    group_parts = []
    for grp in info.groups:
        g = grp.index
        names = [n for n, _ in grp.params]
        template = base_t["state"].get(g) if isinstance(base_t["state"], dict) else None
        plan = states.plan(states.keys(template, names), grp.params, f"group {g}")
        flats: dict[Any, list[Part]] = {None: []}  # None: the fp32 masters
        flats.update({key: [] for key, dtype in plan.items() if dtype is not None})
        for i, (name, shape) in enumerate(grp.params):
            n = math.prod(shape)
            pad = grp.paddings[i] if grp.paddings else 0
            for key, parts in flats.items():
                parts += [Part(f"model.{name}" if key is None else _state_key(name, key), 0, n), Part(None, 0, pad)]
        whole = {key: states.whole(key, names, _lazify((template or {}).get(key), oarchive, {}), f"group {g}")
                 for key, dtype in plan.items() if dtype is None}
        placed, total, ps = partition.stage12_group([(n, math.prod(s)) for n, s in grp.params], grp.paddings, world)
        group_parts.append((grp, plan, flats, whole, _master_dtype(index, names), placed, total, ps,
                            template is not None or bool(plan)))
    for rank in range(world):
        osd: dict = {}
        for key, value in osd_t.items():
            if key in ("base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings",
                       "partition_count", "param_slice_mappings"):
                continue
            osd[key] = _lazify(value, oarchive, {})
        state, fp32, paddings, mappings = {}, [], [], []
        for grp, plan, flats, whole, mdtype, placed, total, ps, has_state in group_parts:
            g = grp.index
            start = rank * ps
            own = max(0, min(ps, total - start))
            fp32.append(_virtual(f"fp32.{g}.{rank}", mdtype, flats[None], start, own))
            if has_state:
                state[g] = {key: (_virtual(f"{key}.{g}.{rank}", dtype, flats[key], start, ps) if dtype is not None
                                  else copy.deepcopy(whole[key])) for key, dtype in plan.items()}
            # DeepSpeed's own bookkeeping of the end padding inside this rank's partition
            paddings.append(ps if total <= start else (start + ps - total if total < start + ps else 0))
            mappings.append(OrderedDict(
                (name, stand_in(standins.FRAGMENT_ADDRESS, numel=numel, start=s))
                for name, numel, s in partition.stage12_slice_mappings(placed, ps, rank)))
        osd["base_optimizer_state"] = {"state": state,
                                       "param_groups": copy.deepcopy(base_t["param_groups"])}
        osd["single_partition_of_fp32_groups"] = fp32
        osd["group_paddings"] = paddings
        pc = osd_t.get("partition_count")
        osd["partition_count"] = [world] * len(pc) if isinstance(pc, list) else world
        osd["param_slice_mappings"] = mappings
        top = {k: _lazify(v, oarchive, {}) for k, v in o0.items() if k != "optimizer_state_dict"}
        files[f"{tag}/{_optim_name(info, rank)}"] = {"optimizer_state_dict": _ordered_like(osd_t, osd), **top}


def _master_dtype(index: CheckpointIndex, names: list[str]) -> str:
    """The dtype of a flat buffer of fp32 masters (DeepSpeed's are float32), the same for all."""
    dtypes = {index.tensors[f"model.{n}"].dtype for n in names}
    if len(dtypes) > 1:
        raise UnsupportedError(f"the master weights of one ZeRO partition have dtypes {sorted(dtypes)} "
                               f"(parameters {names[:3]}...); they cannot share a flat buffer")
    return dtypes.pop() if dtypes else "float32"


def _ordered_like(template: dict, values: dict) -> dict:
    """Keep the template's key order (DeepSpeed does not care, humans diffing files do)."""
    out = {k: values[k] for k in template if k in values}
    out.update({k: v for k, v in values.items() if k not in out})
    return out


def _stage3(index: CheckpointIndex, info: ZeroInfo, world: int, tag: str, files: dict,
            sub_group_size: int | None, states: _States) -> None:
    # params of each torch param group, in order, then DeepSpeed's sub-groups for the new size
    by_group: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for grp in info.groups:
        by_group.setdefault(grp.param_group, []).extend(grp.params)
    subgroups: list[tuple[int, list[tuple[str, tuple[int, ...]]]]] = []
    for g in range(info.param_group_count):
        shapes = dict(by_group.get(g, []))
        for sub in partition.stage3_sub_groups([(n, math.prod(s)) for n, s in by_group.get(g, [])], world,
                                               sub_group_size):
            subgroups.append((g, [(n, shapes[n]) for n, _ in sub]))
    o0, oarchive = _template(info, "optim", 0)
    osd_t = o0["optimizer_state_dict"]
    if "ds_zero_partition_groups" in osd_t:
        raise UnsupportedError("ZeRO-3 checkpoints with expert partition groups are not supported yet")
    inner_t = osd_t["optimizer_state_dict"]
    # the template's keys (every source sub-group has the same ones) and its value of each
    template: dict = {}
    for sub_state in (inner_t["state"].values() if isinstance(inner_t["state"], dict) else []):
        if isinstance(sub_state, dict):
            template.update({k: v for k, v in sub_state.items() if k not in template})
    had_state = bool(inner_t["state"]) if isinstance(inner_t["state"], dict) else False
    plans = []
    for i, (g, params) in enumerate(subgroups):
        names = [n for n, _ in params]
        plan = states.plan(states.keys(template, names), params, f"sub-group {i}")
        whole = {key: states.whole(key, names, _lazify(template.get(key), oarchive, {}), f"sub-group {i}")
                 for key, dtype in plan.items() if dtype is None}
        plans.append((plan, whole, _master_dtype(index, names), had_state or bool(plan)))
    for rank in range(world):
        # model states: one per rank
        m_t, marchive = _template(info, "model", 0)
        model = _lazify(m_t, marchive, {})
        model["dp_world_size"] = world
        model["param_shapes"] = [OrderedDict((n, Size(s)) for n, s in params) for _, params in subgroups]
        if rank != 0:
            model["shared_params"] = {}
        if info.frozen:
            frags = OrderedDict()
            for name, shape in info.frozen.items():
                numel = math.prod(shape)
                per = partition.stage3_slice(numel, world)
                entry = index.tensors[f"model.{name}"]
                frags[name] = _virtual(f"frozen.{name}.{rank}", entry.dtype,
                                       [Part(f"model.{name}", 0, numel)], rank * per, per)
            model["frozen_param_fragments"] = frags
        files[f"{tag}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"] = model
        # optim states
        state, flats = {}, []
        groups_params: dict[int, list[int]] = {}
        for i, ((g, params), (plan, whole, mdtype, has_state)) in enumerate(zip(subgroups, plans)):
            groups_params.setdefault(g, []).append(i)
            parts: dict[Any, list[Part]] = {None: []}  # None: the fp32 masters
            parts.update({key: [] for key, dtype in plan.items() if dtype is not None})
            for name, shape in params:
                numel = math.prod(shape)
                per = partition.stage3_slice(numel, world)
                start = rank * per
                length = max(0, min(per, numel - start))
                for key, target in parts.items():
                    target += [Part(f"model.{name}" if key is None else _state_key(name, key), start, length),
                               Part(None, 0, per - length)]
            size = sum(p.length for p in parts[None])
            flats.append(_virtual(f"fp32.{i}.{rank}", mdtype, parts[None], 0, size))
            if has_state:
                state[i] = {key: (_virtual(f"{key}.{i}.{rank}", dtype, parts[key], 0, size) if dtype is not None
                                  else copy.deepcopy(whole[key])) for key, dtype in plan.items()}
        param_groups = copy.deepcopy(inner_t["param_groups"])
        for g, meta in enumerate(param_groups):
            meta["params"] = groups_params.get(g, [])
        osd = {}
        for key, value in osd_t.items():
            if key == "optimizer_state_dict":
                osd[key] = {"state": state, "param_groups": param_groups}
            elif key == "fp32_flat_groups":
                osd[key] = flats
            elif key == "partition_count":
                osd[key] = world
            else:
                osd[key] = _lazify(value, oarchive, {})
        top = {k: _lazify(v, oarchive, {}) for k, v in o0.items() if k != "optimizer_state_dict"}
        files[f"{tag}/{_optim_name(info, rank)}"] = {"optimizer_state_dict": osd, **top}
