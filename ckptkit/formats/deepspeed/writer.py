"""Write a native (rigid, not universal) DeepSpeed ZeRO checkpoint for a new world size.

Same stage and precision as the source. Everything DeepSpeed's loader and its own tools read is
recomputed for M ranks: partition sizes and paddings, fp32 partitions and Adam moments (as
virtual slices of the per-parameter tensors, streamed), stage-3 sub-groups and frozen fragments,
param_shapes, partition_count, param_slice_mappings, group_paddings, dp_world_size. Everything
else (scheduler, steps, loss scaler, client state, config) is carried over unchanged, the
DeepSpeed classes re-emitted as themselves.
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import Any

from ...errors import FormatError, UnsupportedError, quote
from ...index.types import CheckpointIndex, Piece, TensorEntry, Box
from ...index.virtual import Part, flat_slice
from ...lazy_torch import is_tensor
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


def _step(index: CheckpointIndex, names: list[str]) -> Any:
    steps: list[Any] = []
    for n in names:
        obj = index.objects.get(f"optim.state.{n}.step")
        if obj is not None and not any(_same(obj.data, s) for s in steps):
            steps.append(obj.data)
    if len(steps) > 1:
        raise UnsupportedError(f"parameters {names[:3]}... have different optimizer step counts "
                               f"{sorted(map(repr, steps))}; they cannot share one ZeRO partition")
    return steps[0] if steps else None


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same type (a step as an int, a SmallTensor, a torch tensor)."""
    if type(a) is not type(b):
        return False
    if is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


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
    if info.stage < 3:
        _stage12(index, info, world_size, tag, files)
    else:
        _stage3(index, info, world_size, tag, files, sub_group_size)
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


def _stage12(index: CheckpointIndex, info: ZeroInfo, world: int, tag: str, files: dict) -> None:
    m0, marchive = _template(info, "model", min(info.layout.model_files))
    model = _lazify(m0, marchive, {})
    model["dp_world_size"] = world
    files[f"{tag}/mp_rank_00_model_states.pt"] = model

    o0, oarchive = _template(info, "optim", 0)
    group_parts = []
    for grp in info.groups:
        masters, avg, avg_sq = [], [], []
        for i, (name, shape) in enumerate(grp.params):
            n = math.prod(shape)
            pad = grp.paddings[i] if grp.paddings else 0
            masters += [Part(f"model.{name}", 0, n), Part(None, 0, pad)]
            avg += [Part(f"optim.state.{name}.exp_avg", 0, n), Part(None, 0, pad)]
            avg_sq += [Part(f"optim.state.{name}.exp_avg_sq", 0, n), Part(None, 0, pad)]
        placed, total, ps = partition.stage12_group([(n, math.prod(s)) for n, s in grp.params], grp.paddings, world)
        group_parts.append((grp, masters, avg, avg_sq, placed, total, ps))
    for rank in range(world):
        osd_t = o0["optimizer_state_dict"]
        osd: dict = {}
        for key, value in osd_t.items():
            if key in ("base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings",
                       "partition_count", "param_slice_mappings"):
                continue
            osd[key] = _lazify(value, oarchive, {})
        base_t = osd_t["base_optimizer_state"]
        state, fp32, paddings, mappings = {}, [], [], []
        for grp, masters, avg, avg_sq, placed, total, ps in group_parts:
            g = grp.index
            start = rank * ps
            own = max(0, min(ps, total - start))
            fp32.append(_virtual(f"fp32.{g}.{rank}", "float32", masters, start, own))
            gstate = {}
            for key, value in base_t["state"][g].items():
                if key == "exp_avg":
                    gstate[key] = _virtual(f"exp_avg.{g}.{rank}", "float32", avg, start, ps)
                elif key == "exp_avg_sq":
                    gstate[key] = _virtual(f"exp_avg_sq.{g}.{rank}", "float32", avg_sq, start, ps)
                elif isinstance(value, TensorRef):
                    raise UnsupportedError(f"optimizer state {quote(str(key))} of group {g} is a tensor ckptkit cannot "
                                           f"repartition (only Adam's exp_avg/exp_avg_sq are known)")
                else:
                    gstate[key] = copy.deepcopy(value)
            state[g] = gstate
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


def _ordered_like(template: dict, values: dict) -> dict:
    """Keep the template's key order (DeepSpeed does not care, humans diffing files do)."""
    out = {k: values[k] for k in template if k in values}
    out.update({k: v for k, v in values.items() if k not in out})
    return out


def _stage3(index: CheckpointIndex, info: ZeroInfo, world: int, tag: str, files: dict,
            sub_group_size: int | None) -> None:
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
    first_state = next(iter(inner_t["state"].values()), {})
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
        for i, (g, params) in enumerate(subgroups):
            groups_params.setdefault(g, []).append(i)
            parts = {"model": [], "exp_avg": [], "exp_avg_sq": []}
            for name, shape in params:
                numel = math.prod(shape)
                per = partition.stage3_slice(numel, world)
                start = rank * per
                length = max(0, min(per, numel - start))
                for what, key in (("model", f"model.{name}"), ("exp_avg", f"optim.state.{name}.exp_avg"),
                                  ("exp_avg_sq", f"optim.state.{name}.exp_avg_sq")):
                    parts[what] += [Part(key, start, length), Part(None, 0, per - length)]
            size = sum(p.length for p in parts["model"])
            flats.append(_virtual(f"fp32.{i}.{rank}", "float32", parts["model"], 0, size))
            sub_state = {}
            for key in first_state:
                if key in ("exp_avg", "exp_avg_sq"):
                    sub_state[key] = _virtual(f"{key}.{i}.{rank}", "float32", parts[key], 0, size)
                elif key == "step":
                    sub_state[key] = copy.deepcopy(_step(index, [n for n, _ in params]))
                elif isinstance(first_state[key], TensorRef):
                    raise UnsupportedError(f"optimizer state {quote(str(key))} is a tensor ckptkit cannot repartition")
                else:
                    sub_state[key] = copy.deepcopy(first_state[key])
            state[i] = sub_state
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
