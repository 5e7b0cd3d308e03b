"""Index a DeepSpeed ZeRO checkpoint (stages 1-3, fp32/fp16/bf16) without importing deepspeed.

Keys follow torch's recipe so every other operation treats it like any checkpoint:
  model.<name>                    fp32 master weights (flat-range pieces of the rank partitions),
                                  frozen params (stored precision) and buffers
  optim.state.<name>.<key>        every key of the optimizer's state, whatever the optimizer: a key
                                  with the flat partition's length (exp_avg, momentum_buffer, sum,
                                  square_avg...) as flat-range pieces like the masters; any other
                                  (torch's 0-d step, an int step) as the group's one value, kept
                                  whole for each of its parameters (ckptkit.optim_state)
  optim.param_groups.<g>.<hyper>  hyperparameters; .params lists the group's names
  ds_module.<name>                the low-precision module weights of the model-states file
  ds.<key>                        DeepSpeed's own values (global_steps, lr_scheduler, loss_scaler, ...)
  client.<key>                    client_state passed to save_checkpoint
Tied parameters (shared_params) appear as aliases of their owner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import CkptkitError, FormatError, UnsupportedError, quote
from ...index import problems
from ...index.dtypes import itemsize
from ...index.dtypes import is_floating
from ...index.types import Box, CheckpointIndex, FlatRange, Location, ObjectEntry, Piece, TensorEntry
from ...optim_state import PARTITIONED, WHOLE, kind_of, refuse_unmappable
from ...safeload import Inert, TensorRef
from ...storage.source import Source
from ..torch_save.archive import Archive, load_structure, open_archive, tensor_location
from ..torch_save.reader import materialize
from . import partition, standins
from .files import Layout, locate

FORMAT = "deepspeed"
STRUCTURAL_KEYS = {"module", "buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
                   "shared_params", "optimizer"}
# A state kept whole is copied to every parameter of its group, and every command then walks it
# once per parameter: its values (strings, bytes and tensor data one per 64 bytes) times the
# parameters are held to this. torch's step is one value; a 2M-element list over 5 parameters
# kept `inspect` busy for minutes.
MAX_WHOLE_FANOUT = 1_000_000
DS_KEYS = {"lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps",
           "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
           "checkpoint_parallel_dimensions", "universal_checkpoint_info", "iteration", "compression"}


@dataclass
class Group:
    """One optimizer param group (stage 1/2) or sub-group (stage 3) as laid out on disk."""

    index: int                 # position in the optimizer state (group, or sub-group at stage 3)
    param_group: int           # the torch param group it belongs to
    params: list[tuple[str, tuple[int, ...]]]
    paddings: list[int] | None = None


@dataclass
class ZeroInfo:
    """What the DeepSpeed writer needs beyond the index: the layout and the original structures."""

    stage: int
    world_size: int
    layout: Layout
    groups: list[Group]
    frozen: dict[str, tuple[int, ...]]
    buffers: list[str]
    shared: dict[str, str]
    model_states: dict[int, Any] = field(default_factory=dict)   # rank -> lazy structure
    optim_states: dict[int, Any] = field(default_factory=dict)
    archives: dict[str, Archive] = field(default_factory=dict)
    param_group_count: int = 0
    dtype: str = "float32"


def _get(mapping: Any, key: str, where: str) -> Any:
    if not isinstance(mapping, dict) or key not in mapping:
        raise FormatError(f"{where}: has no {key!r} entry (not a DeepSpeed ZeRO checkpoint of a known version)")
    return mapping[key]


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(d, int) and d >= 0 for d in value):
        raise FormatError(f"{where}: malformed shape {value!r:.60}")
    return tuple(int(d) for d in value)


def _tensor(archive: Archive, value: Any, what: str) -> tuple[str, Location, tuple[int, ...]]:
    if not isinstance(value, TensorRef):
        raise FormatError(f"{archive.label}: {what} is not a tensor (found {type(value).__name__})")
    dtype, loc = tensor_location(archive, value, what)
    return dtype, loc, tuple(value.size)


def read_index(source: Source, tag: str | None = None) -> CheckpointIndex:
    layout = locate(source, tag)
    archives: dict[str, Archive] = {}

    def load(name: str) -> Any:
        rel = layout.prefix + name
        try:
            archive = open_archive(source, rel)
            structure = load_structure(archive, eager=False)
        except CkptkitError as exc:  # verify: listed, and the other ranks are still checked
            if not problems.collecting_now():
                raise
            if _truncated_zip(source, rel):
                exc = FormatError(f"{source.label(rel)}: is truncated: a zip archive without its end record "
                                  f"({source.size(rel)} bytes; the file was cut short)")
            problems.tolerate(exc, source.label(rel))
            return None
        archives[rel] = archive
        return structure

    optim = {r: v for r, n in sorted(layout.optim_files.items()) if (v := load(n)) is not None}
    model = {r: v for r, n in sorted(layout.model_files.items()) if (v := load(n)) is not None}
    if not optim or not model:
        raise FormatError(f"{source.label(layout.prefix)}: no {'optim' if not optim else 'model'}-states file "
                          f"of the tag could be read")
    r0 = min(optim)
    first_optim = layout.prefix + layout.optim_files[r0]
    osd0 = _get(optim[r0], "optimizer_state_dict", source.label(first_optim))
    if "zero_stage" not in osd0:
        raise UnsupportedError(f"{source.label(first_optim)}: optimizer state without a zero_stage: the "
                               f"BF16_Optimizer / ZeRO stage 0 layout is not supported yet")
    stage = int(standins.enum_value(osd0["zero_stage"]))
    if stage not in (1, 2, 3):
        raise UnsupportedError(f"{source.label(first_optim)}: ZeRO stage {stage} is not supported")
    if osd0.get("elastic_checkpoint") or (stage < 3 and "base_optimizer_state" in osd0
                                          and isinstance(osd0["base_optimizer_state"], list)):
        raise UnsupportedError(f"{source.label(first_optim)}: elastic ZeRO checkpoints are not supported yet")
    world = max(layout.optim_files) + 1  # ranks short of it were missing (verify listed them)
    m0_name = layout.prefix + layout.model_files[min(model)]
    m0 = model[min(model)]
    label = source.label(m0_name)
    if stage == 3 and len(layout.model_files) != world and not _tolerate_missing_models(source, layout, world):
        raise FormatError(f"{source.label(layout.prefix)}: ZeRO-3 needs one model-states file per rank, found "
                          f"{len(layout.model_files)} for {world} optim-states files")
    dp = m0.get("dp_world_size") if isinstance(m0, dict) else None
    if isinstance(dp, int) and dp != world:
        raise FormatError(f"{label}: says dp_world_size {dp} but there are {world} optim-states files")

    info = ZeroInfo(stage, world, layout, [], {}, list(_get(m0, "buffer_names", label)),
                    dict(m0.get("shared_params") or {}), model, optim, archives)
    index = CheckpointIndex(format=FORMAT, root=source.root, world_size=world)
    index.native = info
    for rel, arch in archives.items():
        index.files[rel] = source.size(rel)
        index.checks.extend(arch.checks())

    param_shapes = _get(m0, "param_shapes", label)
    if not isinstance(param_shapes, list):
        raise FormatError(f"{label}: param_shapes must be a list of per-group shape maps")
    _module_and_buffers(index, info, archives[m0_name], m0, label)
    _frozen(index, info, archives, model, layout, label)
    if stage < 3:
        _stage12(index, info, archives, optim, layout, param_shapes, source)
    else:
        _stage3(index, info, archives, optim, layout, param_shapes, source)
    for alias, owner in info.shared.items():
        if f"model.{owner}" in index.tensors and f"model.{alias}" not in index.tensors:
            target = index.tensors[f"model.{owner}"]
            index.add_tensor(TensorEntry(f"model.{alias}", target.dtype, target.shape, list(target.pieces),
                                         path=("model", alias), attrs={"alias_of": f"model.{owner}"}))
    _objects(index, info, archives[m0_name], m0, optim[r0])
    steps = index.objects.get("ds.global_steps")
    index.step = steps.data if steps is not None and isinstance(steps.data, int) else None
    index.metadata["deepspeed"] = {"stage": stage, "world_size": world, "tag": layout.tag,
                                   "bf16_file_prefix": layout.bf16_prefix, "dtype": info.dtype}
    index.metadata["consolidate_dtype"] = "float32"  # zero_to_fp32 upcasts frozen params and buffers
    return index


def _module_and_buffers(index: CheckpointIndex, info: ZeroInfo, archive: Archive, m0: dict, label: str) -> None:
    module = _get(m0, "module", label)
    if not isinstance(module, dict):
        raise FormatError(f"{label}: 'module' is not a state dict")
    for name, ref in module.items():
        if not isinstance(ref, TensorRef):
            continue
        dtype, loc, shape = _tensor(archive, ref, f"module[{name}]")
        if name in info.buffers:
            index.add_tensor(TensorEntry(f"model.{name}", dtype, shape, [Piece(Box.whole(shape), loc)],
                                         path=("model", name), attrs={"ds_role": "buffer"}))
        elif math.prod(shape) == 0 and info.stage == 3:
            continue  # ZeRO-3 placeholder for a partitioned parameter
        else:
            if dtype in ("float16", "bfloat16"):
                info.dtype = dtype
            index.add_tensor(TensorEntry(f"ds_module.{name}", dtype, shape, [Piece(Box.whole(shape), loc)],
                                         path=("ds_module", name)))


def _frozen(index: CheckpointIndex, info: ZeroInfo, archives: dict, model: dict, layout: Layout, label: str) -> None:
    m0 = model[min(model)]
    shapes = m0.get("frozen_param_shapes") or {}
    info.frozen = {name: _shape(s, f"{label}: frozen_param_shapes[{name}]") for name, s in shapes.items()}
    if info.stage == 1 or not info.frozen:
        # stage 1 keeps frozen params only in `module`: every module tensor that is neither a
        # buffer nor optimizer-owned (decided after the groups are known, in _stage12)
        return
    for name, shape in info.frozen.items():
        numel = math.prod(shape)
        pieces = []
        if info.stage == 2:
            rel = layout.prefix + layout.model_files[min(layout.model_files)]
            frag = _get(m0.get("frozen_param_fragments") or {}, name, f"{label}: frozen_param_fragments")
            dtype, loc, fshape = _tensor(archives[rel], frag, f"frozen_param_fragments[{name}]")
            if math.prod(fshape) != numel:
                raise FormatError(f"{label}: frozen fragment {name} holds {math.prod(fshape)} elements, "
                                  f"its shape {list(shape)} needs {numel}")
            pieces.append(Piece(FlatRange(0, numel), loc))
        else:
            per = partition.stage3_slice(numel, info.world_size)
            dtype = None
            for rank, state in sorted(model.items()):
                rel = layout.prefix + layout.model_files[rank]
                frags = state.get("frozen_param_fragments") or {}
                frag = _get(frags, name, f"{archives[rel].label}: frozen_param_fragments")
                dtype, loc, fshape = _tensor(archives[rel], frag, f"frozen_param_fragments[{name}]")
                start = rank * per
                length = max(0, min(per, numel - start))
                if math.prod(fshape) < length:
                    raise FormatError(f"{archives[rel].label}: frozen fragment {name} holds {math.prod(fshape)} "
                                      f"elements, rank {rank} needs {length}")
                if length:
                    item = loc.length // max(1, math.prod(fshape))
                    pieces.append(Piece(FlatRange(start, length), Location(loc.file, loc.offset, length * item)))
        if info.stage == 3 and len(model) < info.world_size:  # a rank's file was missing (verify listed it)
            problems.tolerate_keys([f"model.{name}"])
        index.add_tensor(TensorEntry(f"model.{name}", dtype, shape, pieces, path=("model", name),
                                     attrs={"ds_role": "frozen"}))


def _partition(arch: Archive, osd: dict, key: str, i: int, what: str, sizes: tuple[int, ...],
               world: int) -> tuple[str, Location, int]:
    """(dtype, location, length) of rank-local fp32 master partition `i` of `osd[key]`, its
    length and its dtype (a floating one; DeepSpeed keeps fp32 masters) checked."""
    tensors = _get(osd, key, arch.label)
    if not isinstance(tensors, list) or i >= len(tensors):
        raise FormatError(f"{arch.label}: {key} has no {what} {i}")
    dtype, loc, shape = _tensor(arch, tensors[i], f"fp32 partition of {what} {i}")
    if len(shape) != 1 or shape[0] not in sizes:
        raise FormatError(f"{arch.label}: fp32 partition of {what} {i} has {list(shape)} elements, "
                          f"the layout of {world} ranks needs {sizes[0]}")
    if not is_floating(dtype):
        raise FormatError(f"{arch.label}: fp32 partition of {what} {i} is {quote(dtype)}, expected a "
                          f"floating-point tensor (the optimizer's master weights)")
    return dtype, loc, shape[0]


@dataclass
class _StateOf:
    """The optimizer state of one (sub-)group, read rank by rank and checked for consistency."""

    where: str                                   # "group 0" / "sub-group 2"
    params: int = 1                              # parameters of the group: each gets the whole values
    kinds: dict[str, str] = field(default_factory=dict)        # key -> PARTITIONED / WHOLE, in order
    dtypes: dict[str, str] = field(default_factory=dict)       # partitioned key -> dtype
    whole: dict[str, tuple[int, Any]] = field(default_factory=dict)  # whole key -> (first rank read, value)
    keys_rank: int | None = None

    def read(self, arch: Archive, rank: int, gstate: Any, flat: tuple[int, ...]) -> dict[str, Location]:
        """Classify every key of this rank's state (`flat`: the flat partition lengths a
        partitioned state may have); the locations of the partitioned ones."""
        if gstate is None:
            gstate = {}
        if not isinstance(gstate, dict):
            raise FormatError(f"{arch.label}: optimizer state of {self.where} is a "
                              f"{type(gstate).__name__}, expected a dict of per-key values")
        if self.keys_rank is not None and set(gstate) != set(self.kinds):
            raise FormatError(f"{arch.label}: optimizer state of {self.where} has keys "
                              f"{quote(str(sorted(map(str, gstate))))}, rank {self.keys_rank}'s has "
                              f"{quote(str(sorted(map(str, self.kinds))))}; every rank's must match")
        locs: dict[str, Location] = {}
        named: dict[str, Any] = {}
        for key, value in gstate.items():
            if named.setdefault(str(key), key) is not key:  # 1 and "1": one index entry, one value lost
                raise FormatError(f"{arch.label}: optimizer state of {self.where} has keys "
                                  f"{quote(repr(named[str(key)]))} and {quote(repr(key))}, which name the same "
                                  f"state optim.state.<parameter>.{quote(str(key))}; refused, as one would be lost")
            refuse_unmappable(key, f"{arch.label}: {self.where}")
            shape = tuple(value.size) if isinstance(value, TensorRef) else None
            kind = WHOLE
            if shape is not None and any(kind_of(str(key), shape, (n,)) == PARTITIONED for n in flat):
                kind = PARTITIONED
            if self.kinds.setdefault(key, kind) != kind:
                raise FormatError(f"{arch.label}: optimizer state {quote(str(key))} of {self.where} has "
                                  f"{list(shape or ())} elements, not those of rank {self.keys_rank}'s")
            if kind == PARTITIONED:
                dtype, loc, _ = _tensor(arch, value, f"optimizer state {key!r} of {self.where}")
                if self.dtypes.setdefault(key, dtype) != dtype:
                    raise FormatError(f"{arch.label}: optimizer state {quote(str(key))} of {self.where} is "
                                      f"{quote(dtype)}, rank {self.keys_rank}'s is {quote(self.dtypes[key])}")
                locs[key] = loc
            else:
                self._whole(arch, rank, key, value)
        if self.keys_rank is None:
            self.keys_rank = rank
        return locs

    def _whole(self, arch: Archive, rank: int, key: Any, value: Any) -> None:
        """One value for the group: the first rank's, every other rank's checked equal to it
        (a value that differs between ranks has no single owner and would be lost)."""
        value = materialize(value, arch)
        if key not in self.whole:
            limit = MAX_WHOLE_FANOUT // max(1, self.params)
            if _weight(value, limit) > limit:  # every command walks it once per parameter
                raise UnsupportedError(
                    f"{arch.label}: optimizer state {quote(str(key))} of {self.where} is not partitioned with the "
                    f"parameters and too large to keep for each of its {self.params} parameters (over {limit:,} "
                    f"values, {MAX_WHOLE_FANOUT:,} shared by them); a value kept per parameter is a step or "
                    f"another small one")
            self.whole[key] = (rank, value)
        elif not _same_value(self.whole[key][1], value):
            first, kept = self.whole[key]
            raise UnsupportedError(f"{arch.label}: optimizer state {quote(str(key))} of {self.where} is "
                                   f"{quote(repr(value))} here and {quote(repr(kept))} on rank {first}: a value "
                                   f"that is not partitioned with the parameters must be the same on every "
                                   f"rank to be kept per parameter")

    def partitioned(self) -> list[str]:
        return [k for k, kind in self.kinds.items() if kind == PARTITIONED]

    def add_whole(self, index: CheckpointIndex, names: list[str]) -> None:
        """The group's whole values, one entry per parameter (the same value for each)."""
        for key, kind in self.kinds.items():
            if kind == WHOLE:
                for name in names:
                    index.add_object(ObjectEntry(_state_key(name, key), self.whole[key][1],
                                                 path=("optim", "state", name, key)))


def _weight(value: Any, limit: int) -> int:
    """Values inside `value` (strings, bytes and tensor data one per 64 bytes), counted up to
    just past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        total += 1
        if isinstance(v, Inert):
            v = v.to_data()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif isinstance(v, (str, bytes, bytearray)):
            total += len(v) >> 6
        else:
            nbytes = getattr(v, "nbytes", 0)  # a tensor's data
            total += nbytes >> 6 if isinstance(nbytes, int) else 0
    return total


def _same_value(a: Any, b: Any) -> bool:
    """Equal values of the same type, looking inside containers and stand-ins (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Inert):
        return _same_value(a.to_data(), b.to_data())
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values of foreign types that cannot compare: treat as different
        return False


def _flat_pieces(params: list[partition.Placed], start: int, length: int, loc: Location, item: int,
                 out: dict[str, list[Piece]]) -> None:
    """Cut a rank's flat tensor [start, start+length) of a group buffer into per-param pieces."""
    for p in params:
        a, b = max(start, p.offset), min(start + length, p.offset + p.numel)
        if b > a:
            out.setdefault(p.name, []).append(
                Piece(FlatRange(a - p.offset, b - a), Location(loc.file, loc.offset + (a - start) * item, (b - a) * item)))


def _state_key(name: str, key: Any) -> str:
    return f"optim.state.{name}.{key}"


def _stage12(index, info, archives, optim, layout, param_shapes, source) -> None:
    world = info.world_size
    first = layout.prefix + layout.optim_files[min(optim)]
    osd0 = optim[min(optim)]["optimizer_state_dict"]
    paddings = osd0.get("param_alignment_paddings")
    base0 = _get(osd0, "base_optimizer_state", source.label(first))
    groups_meta = _get(base0, "param_groups", source.label(first))
    if len(param_shapes) != len(groups_meta):
        raise FormatError(f"{source.label(first)}: {len(groups_meta)} optimizer groups but param_shapes lists "
                          f"{len(param_shapes)}")
    info.param_group_count = len(groups_meta)
    shapes_by_name: dict[str, tuple[int, ...]] = {}
    pieces: dict[tuple, list[Piece]] = {}   # (name, state key or None for the master) -> pieces
    dtypes: dict[tuple, str] = {}           # the same -> dtype
    for g, shapes in enumerate(param_shapes):
        names = [(n, _shape(s, f"param_shapes[{g}][{n}]")) for n, s in shapes.items()]
        shapes_by_name.update(names)
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        info.groups.append(Group(g, g, names, list(pads) if pads else None))
        placed, total, ps = partition.stage12_group([(n, math.prod(s)) for n, s in names], pads, world)
        of = _StateOf(f"group {g}", len(names))
        damaged: list[str] = []
        for rank in range(world):
            expected = max(0, min(ps, total - rank * ps))  # saved without the end padding (or with it)
            if rank not in optim:  # its file was missing or unreadable (verify listed it)
                damaged += [p.name for p in placed if p.offset < rank * ps + expected and p.offset + p.numel > rank * ps]
                continue
            rel = layout.prefix + layout.optim_files[rank]
            arch = archives[rel]
            osd = optim[rank]["optimizer_state_dict"]
            mdtype, loc, length = _partition(arch, osd, "single_partition_of_fp32_groups", g, "group",
                                             (expected, ps), world)
            cut: dict[str, list[Piece]] = {}
            _flat_pieces(placed, rank * ps, expected, loc, itemsize(mdtype), cut)
            _collect(cut, None, mdtype, pieces, dtypes, arch)
            state = _get(_get(osd, "base_optimizer_state", arch.label), "state", arch.label)
            if not isinstance(state, dict):
                raise FormatError(f"{arch.label}: optimizer state is a {type(state).__name__}, expected a dict")
            for key, sloc in of.read(arch, rank, state.get(g), (ps, length)).items():
                cut = {}
                _flat_pieces(placed, rank * ps, expected, sloc, itemsize(of.dtypes[key]), cut)
                _collect(cut, key, of.dtypes[key], pieces, dtypes, arch)
        _damaged(damaged, of.partitioned())
        of.add_whole(index, [n for n, _ in names])
        for key in of.partitioned():  # a parameter with no elements still has its (empty) state
            for name, _ in names:
                dtypes.setdefault((name, key), of.dtypes[key])
    _add_tensors(index, shapes_by_name, pieces, dtypes)
    if info.stage == 1:  # frozen params live only in `module`
        owned = set(shapes_by_name) | set(info.buffers) | set(info.shared)
        for key in [k for k in index.tensors if k.startswith("ds_module.")]:
            name = key[len("ds_module."):]
            if name not in owned:
                e = index.tensors[key]
                info.frozen[name] = e.shape
                index.add_tensor(TensorEntry(f"model.{name}", e.dtype, e.shape, list(e.pieces),
                                             path=("model", name), attrs={"ds_role": "frozen"}))
    _param_groups(index, groups_meta, [[n for n, _ in grp.params] for grp in info.groups])


def _collect(cut: dict[str, list[Piece]], what: Any, dtype: str, pieces: dict[tuple, list[Piece]],
             dtypes: dict[tuple, str], arch: Archive) -> None:
    """Add one rank's per-parameter pieces of one flat tensor (`what`: a state key, None for the
    fp32 master); a parameter's pieces share one dtype."""
    for name, got in cut.items():
        if dtypes.setdefault((name, what), dtype) != dtype:
            key = f"model.{name}" if what is None else _state_key(name, what)
            raise FormatError(f"{arch.label}: {key} is {quote(dtype)} here, {quote(dtypes[(name, what)])} "
                              f"on another rank")
        pieces.setdefault((name, what), []).extend(got)


def _add_tensors(index: CheckpointIndex, shapes_by_name: dict[str, tuple[int, ...]],
                 pieces: dict[tuple, list[Piece]], dtypes: dict[tuple, str]) -> None:
    """The masters (`model.<name>`), then every partitioned state key (`optim.state.<name>.<key>`),
    one TensorEntry per parameter shaped like it; a zero-size parameter's have no pieces."""
    for name, shape in shapes_by_name.items():
        index.add_tensor(TensorEntry(f"model.{name}", dtypes.get((name, None), "float32"), shape,
                                     pieces.get((name, None), []), path=("model", name),
                                     attrs={"ds_role": "fp32_master"}))
    for (name, what), dtype in dtypes.items():
        if what is not None:
            index.add_tensor(TensorEntry(_state_key(name, what), dtype, shapes_by_name[name],
                                         pieces.get((name, what), []), path=("optim", "state", name, what)))


def _stage3(index, info, archives, optim, layout, param_shapes, source) -> None:
    world = info.world_size
    first = layout.prefix + layout.optim_files[min(optim)]
    inner0 = _get(optim[min(optim)]["optimizer_state_dict"], "optimizer_state_dict", source.label(first))
    groups_meta = _get(inner0, "param_groups", source.label(first))
    info.param_group_count = len(groups_meta)
    sub_to_group = {}
    for g, meta in enumerate(groups_meta):
        for sub in meta.get("params", []):
            sub_to_group[int(sub)] = g
    if sorted(sub_to_group) != list(range(len(param_shapes))):
        raise FormatError(f"{source.label(first)}: optimizer param groups name sub-groups {sorted(sub_to_group)}, "
                          f"param_shapes lists {len(param_shapes)}")
    shapes_by_name: dict[str, tuple[int, ...]] = {}
    pieces: dict[tuple, list[Piece]] = {}
    dtypes: dict[tuple, str] = {}
    group_names: list[list[str]] = [[] for _ in groups_meta]
    for i, shapes in enumerate(param_shapes):
        names = [(n, _shape(s, f"param_shapes[{i}][{n}]")) for n, s in shapes.items()]
        shapes_by_name.update(names)
        group_names[sub_to_group[i]].extend(n for n, _ in names)
        info.groups.append(Group(i, sub_to_group[i], names))
        per = [(n, math.prod(s), partition.stage3_slice(math.prod(s), world)) for n, s in names]
        flat_len = sum(p for _, _, p in per)
        of = _StateOf(f"sub-group {i}", len(names))
        damaged: list[str] = []
        for rank in range(world):
            if rank not in optim:  # its file was missing or unreadable (verify listed it)
                damaged += [n for n, numel, slice_len in per if numel > rank * slice_len]
                continue
            rel = layout.prefix + layout.optim_files[rank]
            arch = archives[rel]
            osd = optim[rank]["optimizer_state_dict"]
            mdtype, loc, _ = _partition(arch, osd, "fp32_flat_groups", i, "sub-group", (flat_len,), world)
            state = _get(_get(osd, "optimizer_state_dict", arch.label), "state", arch.label)
            if not isinstance(state, dict):
                raise FormatError(f"{arch.label}: optimizer state is a {type(state).__name__}, expected a dict")
            flats = [(None, mdtype, loc)]
            flats += [(key, of.dtypes[key], sloc)
                      for key, sloc in of.read(arch, rank, state.get(i), (flat_len,)).items()]
            for what, dtype, l in flats:
                item = itemsize(dtype)
                cut: dict[str, list[Piece]] = {}
                pos = 0
                for name, numel, slice_len in per:
                    start = rank * slice_len
                    length = max(0, min(slice_len, numel - start))
                    if length:
                        cut[name] = [Piece(FlatRange(start, length),
                                           Location(l.file, l.offset + pos * item, length * item))]
                    pos += slice_len
                _collect(cut, what, dtype, pieces, dtypes, arch)
        _damaged(damaged, of.partitioned())
        of.add_whole(index, [n for n, _ in names])
        for key in of.partitioned():
            for name, _ in names:
                dtypes.setdefault((name, key), of.dtypes[key])
    _add_tensors(index, shapes_by_name, pieces, dtypes)
    _param_groups(index, groups_meta, group_names)


def _damaged(names: list[str], keys: list[str]) -> None:
    """Tensors of these parameters lack the pieces of a rank verify already reported."""
    problems.tolerate_keys([k for n in names for k in (f"model.{n}", *(_state_key(n, s) for s in keys))])


def _tolerate_missing_models(source: Source, layout: Layout, world: int) -> bool:
    """ZeRO-3 model-states files missing for some ranks: listed when verify collects (True)."""
    if not problems.collecting_now():
        return False
    for rank in range(world):
        if rank not in layout.model_files:
            name = layout.prefix + f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            problems.tolerate(FormatError(f"{source.label(name)}: file is missing (rank {rank} of {world})"),
                              source.label(name))
    return True


def _truncated_zip(source: Source, rel: str) -> bool:
    """A file that starts as a zip archive but has no end record: it was cut short."""
    try:
        size = source.size(rel)
        if size < 4 or source.read(rel, 0, 4) != b"PK\x03\x04":
            return False
        tail = min(size, (1 << 16) + 22)
        return b"PK\x05\x06" not in source.read(rel, size - tail, tail)
    except CkptkitError:
        return False


def _param_groups(index: CheckpointIndex, groups_meta: list, names: list[list[str]]) -> None:
    for g, meta in enumerate(groups_meta):
        for key, value in meta.items():
            if key == "params":
                value = names[g]
            index.add_object(ObjectEntry(f"optim.param_groups.{g}.{key}", value,
                                         path=("optim", "param_groups", g, key)))


def _objects(index: CheckpointIndex, info: ZeroInfo, archive: Archive, m0: dict, o0: dict) -> None:
    items = [(key, value) for key, value in m0.items() if key not in STRUCTURAL_KEYS]
    values = materialize([value for _, value in items], archive)  # one shared read per storage for them all
    for (key, _), value in zip(items, values):
        container = "ds" if key in DS_KEYS else "client"
        index.add_object(ObjectEntry(f"{container}.{key}", value, path=(container, key)))
    osd = o0["optimizer_state_dict"]
    for key in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad"):
        if key in osd:
            index.add_object(ObjectEntry(f"ds.{key}", osd[key], path=("ds", key)))
    index.add_object(ObjectEntry("ds.zero_stage", info.stage, path=("ds", "zero_stage")))
