"""One typed model of a DeepSpeed checkpoint's layout: its parallel sizes and naming variants.

DeepSpeed lays a checkpoint out over four parallel dimensions (tp, pp, ep, dp) and a ZeRO stage,
with naming variants that depend on how it was trained: pipeline stages as layer files
(PipelineModule) or as model-parallel ranks (a MoE PipelineModule), experts sliced over the tp
ranks or saved whole by one of them, the `bf16_` prefix of BF16_Optimizer's files, Megatron's
`layer_file(XX, TT)`. `DeepSpeedLayout` holds them as data, so the one writer (resharding.py) splits
a checkpoint by what it is, not by the order of type tests, and every refusal of new sizes lives in
one table (`RESIZE_RULES`, keyed by the `family` and applied by `resized`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...errors import FormatError, UnsupportedError, UsageError, quote
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex
from .names import expert_file, model_file, optim_file, zero_model_file

# pipeline stages: none, as per-layer files beside one ZeRO checkpoint per stage (PipelineModule),
# or as model-parallel ranks each holding a whole MoE checkpoint (a MoE PipelineModule)
NO_STAGES, LAYER_FILES, MP_RANK_STAGES = "none", "layer_files", "mp_ranks"
# experts: none; on every mp rank (sliced over tp: enable_expert_tensor_parallelism=True, or tp 1);
# each whole on the one mp rank that saves it (enable_expert_tensor_parallelism=False under tp)
NO_EXPERTS, SLICED_EXPERTS, WHOLE_EXPERTS = "none", "sliced", "whole"

MODEL_PARALLEL = ("tp", "pp", "ep")
LONG_NAMES = {"tp": "tensor-parallel size", "pp": "pipeline size", "ep": "expert-parallel size"}
ADDING = {"tp": "tensor parallelism", "pp": "pipeline parallelism", "ep": "expert parallelism"}
TP_RULES_HINT = (
    "; to add it, give --tp-rules FILE saying how the model built at that tp splits each parameter "
    "(the checkpoint, saved without tp, cannot say; see docs/tp_rules.md)"
)


@dataclass(frozen=True, kw_only=True)
class DeepSpeedLayout:
    """The parallel sizes, the ZeRO stage and the naming variants of one DeepSpeed checkpoint."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1  # data-parallel ranks per (stage, tp rank): the optim-states files of one mp rank
    zero_stage: int = 1  # 0: no ZeRO partitioning (BF16_Optimizer in a pipeline)
    stages: str = NO_STAGES
    experts: str = NO_EXPERTS
    bf16_prefix: bool = False  # optim-states files named with the bf16 prefix (names.optim_file)
    megatron_layer_names: bool = False  # layer files named `layer_file(XX, TT)`
    num_experts: tuple[tuple[str, int], ...] = ()  # MoE layer (module prefix) -> its experts, in order
    grows_tp: bool = False  # saved without tp, its splits given by --tp-rules FILE (grow_tp.py)

    @classmethod
    def of(cls, index: CheckpointIndex) -> "DeepSpeedLayout":
        """The layout of an index the DeepSpeed reader built: its native record's (native.py),
        read from the tag folder's files."""
        layout = getattr(index.native, "layout", None)
        if not isinstance(layout, cls):
            raise FormatError(f"{index.root}: is not a DeepSpeed checkpoint read by ckptkit")
        return layout

    @property
    def family(self) -> str:
        """Which combination of parallel dimensions this is: what RESIZE_RULES keys the sizes a
        reshard may ask for by, and what messages call the checkpoint."""
        if self.stages == LAYER_FILES:
            return "pipeline_tp" if self.tp > 1 or self.grows_tp else "pipeline"
        if self.stages == MP_RANK_STAGES:
            return "pipeline_moe"
        if self.tp > 1 or (self.grows_tp and self.experts == SLICED_EXPERTS):
            return {NO_EXPERTS: "tensor_parallel", SLICED_EXPERTS: "moe_tp", WHOLE_EXPERTS: "moe_whole_tp"}[
                self.experts
            ]
        return "moe" if self.experts != NO_EXPERTS else "zero"

    @property
    def has_experts(self) -> bool:
        return self.experts != NO_EXPERTS

    @property
    def sizes(self) -> ParallelSizes:
        return ParallelSizes(tp=self.tp, pp=self.pp, ep=self.ep, dp=self.dp)

    def mp_rank(self, stage: int = 0, tp_rank: int = 0) -> int:
        """DeepSpeed's model-parallel rank of (pipeline stage, tp rank): stage * tp + tp rank
        (a MoE pipeline's stage; a tensor-parallel checkpoint's tp rank)."""
        return stage * self.tp + tp_rank

    def cell(self, mp_rank: int) -> tuple[int, int]:
        """(pipeline stage, tp rank) of a model-parallel rank: mp_rank's inverse."""
        return divmod(mp_rank, self.tp)

    def model_files(self, mp_rank: int) -> list[str]:
        """The model-states files of model-parallel rank `mp_rank`: one, or one per dp rank at ZeRO-3."""
        if self.zero_stage == 3:
            return [zero_model_file(d, mp_rank) for d in range(self.dp)]
        return [model_file(mp_rank)]

    def optim_files(self, mp_rank: int) -> list[str]:
        """The optim-states files of model-parallel rank `mp_rank`, one per dp rank (its ZeRO partition)."""
        return [optim_file(d, self.bf16_prefix, mp_rank) for d in range(self.dp)]

    def global_rank(self, tp_rank: int, dp_rank: int) -> int:
        """The global rank of (tp rank, dp rank) in a tp x dp grid: the tp ranks are consecutive."""
        return tp_rank + self.tp * dp_rank

    def expert_partitions(self) -> int:
        """How many ranks partition one expert group's flat buffers: the expert-data-parallel
        ranks (dp / ep), over all tp x dp ranks when experts are whole (DeepSpeed then builds the
        expert groups from consecutive global ranks)."""
        ranks = self.tp * self.dp if self.experts == WHOLE_EXPERTS else self.dp
        return ranks // self.ep

    def expert_saver(self, ep_rank: int) -> int:
        """The mp rank whose expert files hold expert-parallel rank `ep_rank`'s experts: its own
        rank % tp when experts are whole, else any (every mp rank saves its slice: 0 named)."""
        return ep_rank % self.tp if self.experts == WHOLE_EXPERTS else 0

    def resized(self, to: int | ParallelSizes, root: str) -> ParallelSizes:
        """The sizes a reshard `--to` gives this checkpoint, refused in one sentence (the rules of
        RESIZE_RULES) when its writer cannot lay them out. A world size N keeps the source's
        model-parallel sizes."""
        rule = RESIZE_RULES[self.family]
        sizes = rule.keep(self, to, root)
        for check in rule.checks:
            check(self, to, sizes)
        return sizes


@dataclass(frozen=True)
class ResizeRule:
    """What a family's writer may change (`resizable`), its name in messages (`kind`), and the
    checks of the new sizes beyond that."""

    resizable: tuple[str, ...]
    kind: str
    checks: tuple[Any, ...] = ()
    keep_world: Any = None  # how a world size keeps the source's sizes (None: keep_parallel_sizes)
    grows_tp: bool = False  # --tp-rules FILE adds tp to it (grow_tp.py)

    def keep(self, layout: DeepSpeedLayout, to: int | ParallelSizes, root: str) -> ParallelSizes:
        if isinstance(to, ParallelSizes) or self.keep_world is None:
            hint = self.grows_tp and layout.tp == 1
            return keep_parallel_sizes(
                root, to, layout.sizes, resizable=self.resizable, kind=self.kind, tp_rules_hint=hint
            )
        return self.keep_world(layout, int(to))


def keep_parallel_sizes(
    root: str,
    to: int | ParallelSizes,
    source: ParallelSizes,
    *,
    resizable: tuple[str, ...],
    kind: str,
    tp_rules_hint: bool = False,
) -> ParallelSizes:
    """The target sizes of a reshard from `--to`, for a writer that lays out new `resizable`
    model-parallel sizes (and dp) of a `kind` checkpoint whose own sizes are `source`.

    ParallelSizes: taken as given, refusing a model-parallel size the writer cannot change (one the
    source has not, such as pipeline parallelism for a tensor-parallel checkpoint). A world size N
    keeps the source's model-parallel sizes: dp = N / (tp * pp), refused when they do not divide N
    (ep is carved out of dp, as DeepSpeed's MoE groups are: it must divide dp). `tp_rules_hint`:
    the refusal of adding tp names --tp-rules FILE, which adds it (grow_tp.py)."""
    if isinstance(to, ParallelSizes):
        for dim in MODEL_PARALLEL:
            if dim in resizable or getattr(to, dim) == getattr(source, dim):
                continue
            if dim == "ep" and source.ep == 1:
                raise UnsupportedError(f"--to {to}: {root} has no mixture-of-experts layers, so ep must be 1")
            fixed = ",".join(
                f"{d}={getattr(source, d)}"
                for d in MODEL_PARALLEL
                if d not in resizable and not (d == "ep" and source.ep == 1)
            )
            verb = "adding" if getattr(source, dim) == 1 else "changing the source's"
            rules = TP_RULES_HINT if dim == "tp" and tp_rules_hint else ""
            raise UnsupportedError(
                f"--to {to}: {verb} {ADDING[dim]} to the {kind} checkpoint {root} is not "
                f"supported yet (give {','.join(f'{d}=...' for d in resizable)},dp=... with {fixed}){rules}"
            )
        return to
    world = int(to)
    kept = [d for d in MODEL_PARALLEL if getattr(source, d) != 1]
    consumed = source.tp * source.pp
    if world % consumed or (world // consumed) % source.ep:
        label = (
            f"{LONG_NAMES[kept[0]]} {getattr(source, kept[0])}"
            if len(kept) == 1
            else f"{' x '.join(kept)} = {' x '.join(str(getattr(source, d)) for d in kept)}"
        )
        hint, rest = {}, world
        for d in kept:  # the largest sizes at most the source's that fit N ranks
            hint[d] = math.gcd(getattr(source, d), rest)
            rest //= hint[d] if d != "ep" else 1
        example = ",".join(f"{d}={hint[d]}" for d in kept) + f",dp={rest}"
        raise UsageError(
            f"--to {world}: the source's {label} does not divide {world} ranks; give the new sizes, e.g. --to {example}"
        )
    return ParallelSizes(tp=source.tp, pp=source.pp, ep=source.ep, dp=world // consumed)


def check_expert_sizes(
    sizes: object, ep: int, dp: int, counts: dict[str, int], dp_word: str = "size", group_of: str = ""
) -> None:
    """Refuse an expert-parallel size that does not divide the data-parallel size or every MoE
    layer's expert count (the sentences every MoE writer gives; `sizes` is the --to text shown,
    `group_of` what an expert-data-parallel group's ranks belong to, e.g. " of a stage")."""
    if dp % ep:
        raise UsageError(
            f"--to {sizes}: the expert-parallel size must divide the data-parallel {dp_word} (each "
            f"expert-data-parallel group holds dp/ep ranks{group_of})"
        )
    check_expert_counts(sizes, ep, counts)


def check_expert_counts(sizes: object, ep: int, counts: dict[str, int]) -> None:
    """Refuse an expert-parallel size that does not divide every MoE layer's expert count."""
    odd = {prefix: n for prefix, n in counts.items() if n % ep}
    if odd:
        prefix, n = next(iter(odd.items()))
        raise UsageError(
            f"--to {sizes}: MoE layer {quote(prefix)} has {n} experts, which {ep} expert-parallel "
            f"ranks cannot share equally (ep must divide every layer's expert count: "
            f"{sorted(set(counts.values()))})"
        )


def _zero_keep(root: str, to: int | ParallelSizes) -> ParallelSizes:
    if isinstance(to, ParallelSizes):
        if to.tp == to.pp == to.ep == 1:  # dp alone: a world size
            return ParallelSizes(dp=to.dp)
        raise UnsupportedError(
            f"--to {to}: not supported yet for {root} (ep=... needs a mixture-of-experts "
            f"checkpoint; give a world size to reshard its data-parallel ranks)"
        )
    return ParallelSizes(dp=int(to))


def _whole_world(layout: DeepSpeedLayout, world: int) -> ParallelSizes:
    """A world size N for whole experts: tp and ep must both divide N (the expert groups span the
    tp x dp ranks, not the dp ranks alone)."""
    if world % layout.tp or world % layout.ep:
        raise UsageError(
            f"--to {world}: the source's tp {layout.tp} and ep {layout.ep} must both divide {world} "
            f"ranks; give the new sizes, e.g. --to tp=1,ep={math.gcd(layout.ep, world)},dp={world}"
        )
    return ParallelSizes(tp=layout.tp, ep=layout.ep, dp=world // layout.tp)


def _moe_sizes(layout: DeepSpeedLayout, to: int | ParallelSizes, sizes: ParallelSizes) -> None:
    counts = dict(layout.num_experts)
    check_expert_sizes(f"ep={sizes.ep},dp={sizes.dp}", sizes.ep, sizes.dp, counts, "world size", "")


def _lane_sizes(layout: DeepSpeedLayout, to: int | ParallelSizes, sizes: ParallelSizes) -> None:
    counts = dict(layout.num_experts)
    check_expert_sizes(sizes, sizes.ep, sizes.dp, counts, group_of=" of a tensor-parallel lane")


def _stage_sizes(layout: DeepSpeedLayout, to: int | ParallelSizes, sizes: ParallelSizes) -> None:
    check_expert_sizes(sizes, sizes.ep, sizes.dp, dict(layout.num_experts), group_of=" of a stage")


def _whole_sizes(layout: DeepSpeedLayout, to: int | ParallelSizes, sizes: ParallelSizes) -> None:
    """Whole experts: ep divides the tp x dp ranks and every layer's expert count, and tp divides
    ep (else DeepSpeed cannot load the experts: at tp 4, ep 2 rank 2 reads
    expert_file(0, 0, 2), which rank 0 never saves)."""
    ranks = sizes.tp * sizes.dp
    if ranks % sizes.ep:
        raise UsageError(
            f"--to {sizes}: the expert-parallel size must divide the {ranks} ranks (tp x dp: "
            f"DeepSpeed groups experts over consecutive ranks when enable_expert_tensor_parallelism "
            f"is False)"
        )
    counts = dict(layout.num_experts)
    check_expert_counts(sizes, sizes.ep, counts)
    if sizes.ep % sizes.tp:
        r = next(r for r in range(ranks) if r % sizes.tp != (r % sizes.ep) % sizes.tp)
        expert = (r % sizes.ep) * (next(iter(counts.values())) // sizes.ep)
        raise UsageError(
            f"--to {sizes}: the tensor-parallel size must divide the expert-parallel size: DeepSpeed "
            f"0.19.8 saves ep rank e's experts under mp rank e % tp but each rank loads its experts under "
            f"its own mp rank, so rank {r} would look for {expert_file(0, expert, r % sizes.tp)}, which no rank saves"
        )


class _ZeroRule(ResizeRule):
    def keep(self, layout: DeepSpeedLayout, to: int | ParallelSizes, root: str) -> ParallelSizes:
        return _zero_keep(root, to)


# family -> what its writer may change, and the refusals beyond that: every reshard refusal of
# new sizes, in one place
RESIZE_RULES: dict[str, ResizeRule] = {
    "zero": _ZeroRule((), "ZeRO"),
    "tensor_parallel": ResizeRule(("tp",), "tensor-parallel"),
    "pipeline": ResizeRule(("pp",), "pipeline", grows_tp=True),
    "pipeline_tp": ResizeRule(("tp", "pp"), "3-D (pipeline x tensor-parallel)"),
    "moe": ResizeRule(("ep",), "mixture-of-experts", (_moe_sizes,), grows_tp=True),
    "moe_tp": ResizeRule(("tp", "ep"), "mixture-of-experts tensor-parallel", (_lane_sizes,)),
    "moe_whole_tp": ResizeRule(("tp", "ep"), "mixture-of-experts tensor-parallel", (_whole_sizes,), _whole_world),
    "pipeline_moe": ResizeRule(("pp", "ep"), "mixture-of-experts PipelineModule", (_stage_sizes,)),
}
