"""DeepSpeed mixture-of-experts checkpoints (`deepspeed.moe.layer.MoE`, ZeRO 1/2): the expert files
and the expert param groups, under each expert's global id.

What DeepSpeed 0.19 writes for E-way expert parallelism over W ranks (engine._save_moe_checkpoint,
_save_zero_checkpoint; rank r is expert-parallel rank r % E and expert-data-parallel rank r // E,
groups._create_expert_and_data_parallel):
  model_file(0)                     the dense module (expert weights removed), `num_experts` per
                                    MoE layer and rank 0's `param_shapes`, which name rank 0's LOCAL
                                    experts (`<moe>.deepspeed_moe.experts.deepspeed_experts.<local>.*`)
  expert_file(L, G, 0)
                                    MoE layer L's expert G (global id): its module weights, named
                                    `<moe>.deepspeed_moe.experts.deepspeed_experts.<G>.<param>`
  optim_file(r, bf16, mp=0)
                                    rank r's dense groups, partitioned over all W ranks, and its
                                    expert groups (param groups with `moe: True`, named
                                    `ep_size_<E>`), partitioned over the W/E ranks of its
                                    expert-data-parallel group and holding its local experts.
Every expert tensor gets the global name DeepSpeed's expert files use (local id + ep rank times
the layer's local experts) and `attrs["parallel"] = {"ep": {"rank": <ep rank>, "size": E}}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from ...errors import FormatError, UnsupportedError, quote
from ...index.types import Box, CheckpointIndex, Piece, TensorEntry
from ...runner.torch_archive import Archive, load_structure, open_archive
from ...safeload import TensorRef
from ...storage.source import Source
from .entries import tensor_of
from .files import ZeroFiles
from .flat_groups import RankFiles, read_flat_groups
from .info import ZeroGroup, stage_names
from .names import EXPERT_FILE, expert_file

MARK = ".deepspeed_moe.experts.deepspeed_experts."
GROUP_NAME = re.compile(r"^ep_size_(\d+)$")


@dataclass(frozen=True, kw_only=True)
class ExpertLayout:
    """How the experts are spread: E expert-parallel ranks, W/E expert-data-parallel ranks, and
    per MoE layer (its module prefix, in model order) its number of experts."""

    ep: int
    world: int
    layers: dict[str, int]  # MoE module prefix -> global experts, in layer-id order

    @property
    def edp(self) -> int:
        return self.world // self.ep

    def rank(self, ep_rank: int, edp_rank: int) -> int:
        return ep_rank + edp_rank * self.ep

    def local_experts(self, prefix: str) -> int:
        return self.layers[prefix] // self.ep

    def global_name(self, name: str, ep_rank: int) -> str:
        """`name` with its local expert id made global (DeepSpeed's own renaming)."""
        prefix, local, rest = split_expert_name(name)
        return f"{prefix}{MARK}{local + ep_rank * self.local_experts(prefix)}.{rest}"


def split_expert_name(name: str, where: str = "param_shapes") -> tuple[str, int, str]:
    """(MoE module prefix, expert id, parameter) of an expert parameter's name (`where`: the file
    that names it, for the error)."""
    prefix, marked, tail = name.partition(MARK)
    expert, _, rest = tail.partition(".")
    if not marked or not expert.isdigit() or not rest:
        raise FormatError(
            f"{where}: expert parameter {quote(name)} is not named <moe>{MARK}<id>.<param> "
            f"(the names deepspeed.moe.layer.MoE gives its experts)"
        )
    return prefix, int(expert), rest


def read_experts(
    source: Source,
    index: CheckpointIndex,
    stage: int,
    ranks: RankFiles,
    groups_meta: list,
    groups: list[ZeroGroup],
    m0: dict,
    label: str,
) -> tuple[list[ZeroGroup], list[ZeroGroup]]:
    """Read the expert groups (into `index`) and the expert files' module weights. Returns the
    dense groups, for the reader's usual path, and every group with the experts' global names,
    for the param-group listing."""
    files = ranks.files
    if m0.get("ds_autoep_layers"):
        raise UnsupportedError(
            f"{label}: records AutoEP layers (ds_autoep_layers): checkpoints of DeepSpeed's "
            f"AutoEP experts are not supported yet, only deepspeed.moe.layer.MoE"
        )
    if stage == 3:
        raise UnsupportedError(
            f"{source.label(files.prefix + files.expert_files[0])}: mixture-of-experts "
            f"checkpoints at ZeRO stage 3 are not supported yet"
        )
    expert_ids = [g.index for g in groups if is_expert_group(groups_meta[g.param_group])]
    if not expert_ids:
        raise FormatError(
            f"{source.label(files.prefix + files.expert_files[0])}: is a mixture-of-experts expert "
            f"file, but no optimizer param group of "
            f"{source.label(files.prefix + files.optim_files[min(files.optim_files)])} is an expert "
            f"group (moe: true)"
        )
    layout = expert_layout(source, files, ranks, groups_meta, [groups[i] for i in expert_ids], m0, label)
    expert_files = open_expert_files(source, index, files, ranks.archives, layout, [groups[i] for i in expert_ids])
    listed: list[ZeroGroup] = []
    for ep_rank in range(layout.ep):
        renamed = [
            replace(groups[i], params=tuple((layout.global_name(n, ep_rank), s) for n, s in groups[i].params))
            for i in expert_ids
        ]
        read_flat_groups(index, stage, ep_view(ranks, layout, ep_rank), renamed, stage_names(stage))
        mark_expert_owners(index, renamed, ep_rank, layout.ep)
        listed += renamed
    add_expert_module_weights(index, expert_files, layout)
    index.metadata["parallel"] = {"ep": layout.ep, "dp": layout.world}
    index.metadata["deepspeed_moe"] = {
        "ep_size": layout.ep,
        "expert_dp_size": layout.edp,
        "num_experts": dict(layout.layers),
    }
    dense = [g for g in groups if g.index not in expert_ids]
    return dense, sorted(dense + listed, key=lambda g: g.index)


def is_expert_group(meta: Any) -> bool:
    return isinstance(meta, dict) and bool(meta.get("moe"))


def expert_layout(
    source: Source,
    files: ZeroFiles,
    ranks: RankFiles,
    groups_meta: list,
    expert_groups: list[ZeroGroup],
    m0: dict,
    label: str,
) -> ExpertLayout:
    """E from the expert groups' names (`ep_size_<E>`), checked against their partition counts and
    the world; the MoE layers from the expert names, with `num_experts` of the model-states file."""
    optim_label = source.label(files.prefix + files.optim_files[min(files.optim_files)])
    sizes = set()
    for group in expert_groups:
        name = groups_meta[group.param_group].get("name")
        match = GROUP_NAME.match(name) if isinstance(name, str) else None
        if match is None:
            raise FormatError(
                f"{optim_label}: expert param group {group.param_group} is named {quote(str(name))}, "
                f"expected ep_size_<expert-parallel size>"
            )
        sizes.add(int(match.group(1)))
    if len(sizes) != 1:
        raise UnsupportedError(
            f"{optim_label}: MoE layers with different expert-parallel sizes {sorted(sizes)} are not supported yet"
        )
    ep, world = sizes.pop(), ranks.world_size
    if ep < 1 or world % ep:
        raise FormatError(f"{optim_label}: expert-parallel size {ep} does not divide the {world} ranks")
    counts = ranks.optim[min(ranks.optim)]["optimizer_state_dict"].get("partition_count")
    for group in expert_groups:
        if isinstance(counts, list) and group.index < len(counts) and counts[group.index] != world // ep:
            raise FormatError(
                f"{optim_label}: expert group {group.index} is partitioned over {counts[group.index]} "
                f"ranks, expert-parallel size {ep} of {world} ranks needs {world // ep}"
            )
    prefixes: list[str] = []
    for group in expert_groups:
        for name in group.names:
            if (prefix := split_expert_name(name, label)[0]) not in prefixes:
                prefixes.append(prefix)
    num_experts = m0.get("num_experts")
    if (
        not isinstance(num_experts, list)
        or len(num_experts) != len(prefixes)
        or not all(isinstance(n, int) and n > 0 and n % ep == 0 for n in num_experts)
    ):
        raise FormatError(
            f"{label}: num_experts is {quote(repr(num_experts))}, expected one expert count per MoE "
            f"layer ({len(prefixes)}), each a multiple of the expert-parallel size {ep}"
        )
    layout = ExpertLayout(ep=ep, world=world, layers=dict(zip(prefixes, num_experts)))
    for group in expert_groups:
        for name in group.names:
            prefix, local, _ = split_expert_name(name)
            if local >= layout.local_experts(prefix):
                raise FormatError(
                    f"{label}: param_shapes names local expert {local} of {quote(prefix)}, which has "
                    f"{layout.local_experts(prefix)} experts per rank"
                )
    return layout


@dataclass(frozen=True, kw_only=True)
class _ExpertFile:
    layer: int
    expert: int
    rel: str
    archive: Archive
    tensors: dict[str, TensorRef]


def open_expert_files(
    source: Source,
    index: CheckpointIndex,
    files: ZeroFiles,
    archives: dict[str, Archive],
    layout: ExpertLayout,
    expert_groups: list[ZeroGroup],
    mp_of: Callable[[int], int] | None = None,
) -> list[_ExpertFile]:
    """Every expert file there must be (one per layer and global expert), opened and checked:
    its tensors are the expert's parameters, shaped as the optimizer's param_shapes say.
    `mp_of(ep rank)`: the mp rank whose files hold that ep rank's experts (default: files.mp_rank;
    join_ep.py: the one DeepSpeed saves them from)."""
    mp_of = mp_of or (lambda ep_rank: files.mp_rank)
    found: dict[tuple[int, int], str] = {}
    for name in files.expert_files:
        layer, expert, mp = EXPERT_FILE.match(name).groups()
        if layer is None:
            raise UnsupportedError(
                f"{source.label(files.prefix + name)}: expert files without a layer id (written "
                f"by DeepSpeed before 0.6) are not supported"
            )
        found[(int(layer), int(expert))] = name
    shapes: dict[tuple[str, int], dict[str, tuple[int, ...]]] = {}  # (prefix, local id) -> param -> shape
    for group in expert_groups:
        for name, shape in group.params:
            prefix, local, rest = split_expert_name(name)
            shapes.setdefault((prefix, local), {})[rest] = shape
    opened = []
    for layer, (prefix, count) in enumerate(layout.layers.items()):
        for expert in range(count):
            name = found.pop((layer, expert), None)
            ep_rank = expert // layout.local_experts(prefix)
            expected = expert_file(layer, expert, mp_of(ep_rank))
            if name is None:
                raise FormatError(
                    f"{source.label(files.prefix + expected)}: expert file is missing (MoE layer "
                    f"{layer}, {quote(prefix)}, has {count} experts)"
                )
            if name != expected:  # files.py sorts them by mp rank: only a changed layout gets here
                raise FormatError(
                    f"{source.label(files.prefix + expected)}: expert file is missing: expert {expert} "
                    f"(expert-parallel rank {ep_rank}) is saved by model-parallel rank "
                    f"{mp_of(ep_rank)}, but only {name} holds it"
                )
            opened.append(_open_expert(source, index, files.prefix + name, archives, layer, expert))
            local = expert % layout.local_experts(prefix)
            want = {f"{prefix}{MARK}{expert}.{rest}": shape for rest, shape in shapes.get((prefix, local), {}).items()}
            _check_expert(opened[-1], want)
    if found:
        extra = sorted(found.values())[0]
        raise FormatError(
            f"{source.label(files.prefix + extra)}: expert file of no MoE layer/expert the optimizer "
            f"state knows ({len(layout.layers)} layer(s): {dict(layout.layers)} experts)"
        )
    return opened


def _open_expert(
    source: Source, index: CheckpointIndex, rel: str, archives: dict[str, Archive], layer: int, expert: int
) -> _ExpertFile:
    archive = open_archive(source, rel)
    structure = load_structure(archive, eager=False)
    archives[rel] = archive
    index.files[rel] = source.size(rel)
    index.checks.extend(archive.checks())
    if not isinstance(structure, dict):
        raise FormatError(f"{archive.label}: is a {type(structure).__name__}, expected a dict of expert tensors")
    return _ExpertFile(layer=layer, expert=expert, rel=rel, archive=archive, tensors=structure)


def _check_expert(found: _ExpertFile, want: dict[str, tuple[int, ...]]) -> None:
    label = found.archive.label
    missing = [k for k in want if k not in found.tensors]
    if missing:
        raise FormatError(
            f"{label}: has no {quote(missing[0])} entry (expert {found.expert} of MoE layer "
            f"{found.layer} has {len(want)} parameters)"
        )
    extra = [k for k in found.tensors if k not in want]
    if extra:
        raise UnsupportedError(
            f"{label}: {quote(str(extra[0]))} is not a trained parameter of expert {found.expert} "
            f"(frozen expert parameters are not supported yet)"
        )
    for key, shape in want.items():
        value = found.tensors[key]
        if not isinstance(value, TensorRef):
            raise FormatError(f"{label}: {quote(key)} is not a tensor (found {type(value).__name__})")
        if tuple(value.size) != tuple(shape):
            raise FormatError(
                f"{label}: {quote(key)} has shape {list(value.size)}, the optimizer's param_shapes say {list(shape)}"
            )


def ep_view(ranks: RankFiles, layout: ExpertLayout, ep_rank: int) -> RankFiles:
    """The optim-states files of one expert-parallel rank's expert-data-parallel group, numbered
    0..W/E-1 as the expert groups' partitions are."""
    members = {d: layout.rank(ep_rank, d) for d in range(layout.edp)}
    files = replace(
        ranks.files,
        optim_files={d: ranks.files.optim_files[r] for d, r in members.items() if r in ranks.files.optim_files},
    )
    return RankFiles(
        files=files,
        archives=ranks.archives,
        world_size=layout.edp,
        optim={d: ranks.optim[r] for d, r in members.items() if r in ranks.optim},
    )


def mark_expert_owners(index: CheckpointIndex, groups: list[ZeroGroup], ep_rank: int, ep: int) -> None:
    """The expert tensors' owner: attrs["parallel"]["ep"]."""
    names = {n for g in groups for n in g.names}
    for key, entry in index.tensors.items():
        name = _param_of(key)
        if name in names:
            entry.attrs["parallel"] = {"ep": {"rank": ep_rank, "size": ep}}


def _param_of(key: str) -> str | None:
    if key.startswith("model."):
        return key[len("model.") :]
    if key.startswith("optim.state."):
        return key[len("optim.state.") :].rsplit(".", 1)[0]
    return None


def add_expert_module_weights(index: CheckpointIndex, expert_files: list[_ExpertFile], layout: ExpertLayout) -> None:
    """Each expert's low-precision module weights as `ds_module.<global name>`."""
    for found in expert_files:
        prefix = list(layout.layers)[found.layer]
        ep_rank = found.expert // layout.local_experts(prefix)
        for name, ref in found.tensors.items():
            dtype, loc, shape = tensor_of(found.archive, ref, name)
            index.add_tensor(
                TensorEntry(
                    f"ds_module.{name}",
                    dtype,
                    shape,
                    [Piece(Box.whole(shape), loc)],
                    path=("ds_module", name),
                    attrs={"parallel": {"ep": {"rank": ep_rank, "size": layout.ep}}},
                )
            )
