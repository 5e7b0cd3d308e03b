"""The join over ep where it spans the tp ranks: whole experts (read.py's join after tp).

Experts sliced over the tp ranks (or at tp 1) are joined over ep inside each (stage, tp rank)
cell as it is read (moe.py's `read_experts`). This module joins them when DeepSpeed MoE runs with
tensor parallelism and `MoE(..., enable_expert_tensor_parallelism=False)` (Megatron-DeepSpeed's
default): the experts whole, each saved by one mp rank.

What DeepSpeed 0.19.8 does (moe/layer.py _create_process_groups: with the option False it calls
groups._create_expert_and_data_parallel(E) without the mpu's sizes, its legacy path): expert-parallel
groups of E consecutive global ranks, expert-data-parallel groups of the ranks r, r+E, r+2E, ...
With a Megatron mpu (tp ranks consecutive: global rank r is tp rank r % T, dp rank r // T):
  rank r                     expert-parallel rank r % E, expert-data-parallel rank r // E of W/E
  expert_file(L, G, t)
                             expert G whole, saved by global rank e = G // (experts per ep rank)
                             (expert-dp rank 0), so t = e % T: mp ranks >= E save none
  optim_file(d, bf16, mp=t)
                             rank r = t + T*d: its dense groups (partition d of its tp lane, as
                             any TP checkpoint) and its expert groups, partition r // E of W/E,
                             holding ep rank r % E's local experts: one expert group spans files of
                             every mp rank
  model_file(t) the dense module slices; param_shapes names local experts
So the dense groups are read per mp rank and joined over tp (join_tp.py); the expert groups
are read here across all W optim files as one MoE checkpoint of W ranks (moe.py's reading), and
the expert files from the mp rank that saved each. Expert tensors carry attrs["parallel"]["ep"]
only (no tp: they are not split).
"""

from __future__ import annotations

from dataclasses import replace

from ...errors import FormatError
from ...index.state_keys import param_group_key, param_group_path
from ...index.types import CheckpointIndex, ObjectEntry
from ...storage.source import Source
from . import moe
from .files import ZeroFiles
from .flat_groups import RankFiles, read_flat_groups
from .info import ZeroGroup, ZeroInfo, stage_names
from .layout import WHOLE_EXPERTS, DeepSpeedLayout


def dense_groups(groups_meta: list, groups: list[ZeroGroup]) -> list[ZeroGroup]:
    """The groups one mp rank's files hold whole among its tp lane (the expert groups are not)."""
    return [g for g in groups if not moe.is_expert_group(groups_meta[g.param_group])]


def global_ranks(files: ZeroFiles, infos: dict[int, ZeroInfo]) -> RankFiles:
    """All optim-states files as the W ranks of one job: rank t + T*d is file (dp d, mp t)."""
    tp = len(infos)
    dps = {t: info.world_size for t, info in infos.items()}
    if len(set(dps.values())) != 1:
        raise FormatError(
            f"{files.prefix or '.'}: the model-parallel ranks have different numbers of optim-states files ({dps})"
        )
    dp = dps[0]
    grid = DeepSpeedLayout(tp=tp, dp=dp, experts=WHOLE_EXPERTS)
    optim_files, optim, archives = {}, {}, {}
    for t, info in infos.items():
        archives.update(info.archives)
        for d, name in info.files.optim_files.items():
            optim_files[grid.global_rank(t, d)] = name
            if d in info.optim_states:
                optim[grid.global_rank(t, d)] = info.optim_states[d]
    every = [n for f in files.model_parallel.values() for n in f.expert_files]
    gfiles = replace(files.model_parallel[0], optim_files=optim_files, expert_files=sorted(every))
    return RankFiles(files=gfiles, archives=archives, optim=optim, world_size=tp * dp)


def join(source: Source, files: ZeroFiles, index: CheckpointIndex, infos: dict[int, ZeroInfo]) -> None:
    """The experts into the index joined over tp from the cells `infos` (tp rank -> ZeroInfo):
    masters, optimizer state and module weights under their global names, the param groups'
    `params` renamed likewise, the sizes in metadata."""
    tp = len(infos)
    saver = DeepSpeedLayout(tp=tp, experts=WHOLE_EXPERTS)  # mp rank ep_rank % tp saves its experts
    info0 = infos[0]
    ranks = global_ranks(files, infos)
    o0 = ranks.optim[min(ranks.optim)]
    groups_meta = o0["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    m0 = info0.model_states[min(info0.model_states)]
    label = source.label(files.prefix + info0.files.model_files[min(info0.files.model_files)])
    if info0.stage == 3:
        raise FormatError(
            f"{label}: a mixture-of-experts checkpoint at ZeRO stage 3 (DeepSpeed does not save "
            f"one with tensor parallelism)"
        )
    expert_groups = [g for g in info0.groups if moe.is_expert_group(groups_meta[g.param_group])]
    layout = moe.expert_layout(source, ranks.files, ranks, groups_meta, expert_groups, m0, label)
    expert_files = moe.open_expert_files(
        source, index, ranks.files, ranks.archives, layout, expert_groups, mp_of=saver.expert_saver
    )
    for f in expert_files:
        index.files.setdefault(f.rel, source.size(f.rel))
    listed: dict[int, list[str]] = {}
    for ep_rank in range(layout.ep):
        renamed = [
            replace(g, params=tuple((layout.global_name(n, ep_rank), s) for n, s in g.params)) for g in expert_groups
        ]
        read_flat_groups(index, info0.stage, moe.ep_view(ranks, layout, ep_rank), renamed, stage_names(info0.stage))
        moe.mark_expert_owners(index, renamed, ep_rank, layout.ep)
        for g in renamed:
            listed.setdefault(g.param_group, []).extend(g.names)
    moe.add_expert_module_weights(index, expert_files, layout)
    for g, names in listed.items():
        index.add_object(ObjectEntry(param_group_key(g, "params"), names, path=param_group_path(g, "params")))
    dp = index.metadata["parallel"]["dp"]
    index.metadata["parallel"] = {"tp": tp, "ep": layout.ep, "dp": dp}
    index.metadata["deepspeed_moe"] = {
        "ep_size": layout.ep,
        "expert_dp_size": layout.edp,
        "num_experts": dict(layout.layers),
        "experts": "whole",
    }
