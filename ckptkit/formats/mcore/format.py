"""The Megatron-Core format's adapter: `dist_checkpointing` (torch_dist) iteration folders and
Megatron-LM's save root, read through the DCP reader; legacy rank files refused (formats/protocols.py).

It comes before DCP in the registry's order: an iteration folder is a DCP folder too, and what
tells it apart (metadata.json, common.pt, its keys) is only read here. consolidate writes
safetensors from what is read here, one tensor per layer (`consolidated_model`); convert and
consolidate --include-optimizer read it as a training state in torch's terms (`training_index`,
training.py); reshard --to tp=..,pp=.. writes an MCore checkpoint at the new layout
(target_plan.py decides or refuses, writer.py writes). convert --to mcore is not built yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import UnsupportedError, UsageError
from ...index.types import CheckpointIndex, TensorEntry
from ...storage.source import Source
from ..protocols import ANY_WORLD, TO_PARALLEL_SIZES, Capabilities, CannotReshard, IndexReader, ReadOptions
from . import legacy
from . import reader as mcore_reader
from . import target_plan, training, unstack
from .writer import McoreTarget, write_mcore

if TYPE_CHECKING:
    from ...context import RunContext
    from ...index.parallel_spec import ParallelSizes


class McoreFormat(IndexReader, CannotReshard):
    name = "mcore"
    capabilities = Capabilities(
        layouts=(),
        world_sizes=ANY_WORLD,
        optimizer_state=True,
        reshards=True,
        reshard_targets=(TO_PARALLEL_SIZES,),
        model_only_reshard=True,
        tags=True,  # an iteration folder of a save root: --tag iter_0000002
    )

    def detect(self, source: Source, name: str | None = None, *, tag: str | None = None) -> bool:
        """An iteration folder (metadata.json: torch_dist), a save root (latest_checkpointed_iteration.txt),
        or a legacy checkpoint split over ranks (its rank folders, or one rank's file saying so in its args)."""
        if name is not None:
            return legacy.split_file(source, name) is not None
        if not source.isdir(""):
            return False
        if mcore_reader.is_iteration(source) or source.exists(mcore_reader.LATEST):
            return True
        if len(legacy.rank_folders(source)) > 1:
            return True
        files = [n for n in source.listdir("") if n == legacy.RANK_FILE]
        return len(files) == 1 and legacy.split_file(source, files[0]) is not None

    def read(self, source: Source, options: ReadOptions) -> CheckpointIndex:
        name = options.name
        rank_file = name if name is not None else legacy.RANK_FILE if source.exists(legacy.RANK_FILE) else None
        if rank_file is not None:
            args = legacy.split_file(source, rank_file)
            if args is not None:
                raise legacy.refuse_rank_file(source.label(rank_file), args)
        return mcore_reader.read_index(source, options.tag)

    def tag_for_step(self, path: str, source: Source, step: int) -> str | None:
        """--step N in a save root: its iteration folder iter_%07d (None: not a save root)."""
        held = mcore_reader.iterations(source)
        if not held and not source.exists(mcore_reader.LATEST):
            return None
        name = f"iter_{step:07d}"
        if name in held:
            return name
        raise UsageError(
            f"{path}: no iteration {step} in this Megatron save folder (iterations: {', '.join(held) or 'none'})"
        )

    def consolidated_model(
        self, index: CheckpointIndex, model: dict[str, str], include_optimizer: bool
    ) -> tuple[dict[str, str], dict[str, TensorEntry], list[str]]:
        """consolidate's model: one tensor per layer and expert in state_dict() names (unstack.py)."""
        return unstack.consolidated_model(index, model, include_optimizer)

    def training_index(
        self, index: CheckpointIndex, optimizer: bool = True, model_only_hint: str = "", where: str = ""
    ) -> tuple[CheckpointIndex, list[str]]:
        """convert's (and consolidate --include-optimizer's) view: torch's training-state names
        per layer, the param groups given their members (training.py)."""
        return training.training_index(index, optimizer, model_only_hint or training.MODEL_ONLY_HINT, where)

    def write(self, target: Any, out: object, ctx: "RunContext") -> list[str]:
        if isinstance(target, McoreTarget):
            return write_mcore(target, out, ctx)
        raise UnsupportedError("writing Megatron-Core checkpoints is not supported yet")

    def reshard(self, opened: Any, out: object, world_size: int, ctx: "RunContext") -> list[str]:
        raise UsageError(
            f"{opened.path}: a Megatron-Core checkpoint is laid out by tensor, pipeline and data parallel "
            f"sizes, not a world size: give them, --to tp=T,pp=P[,dp=D]"
        )

    def reshard_parallel(
        self, opened: Any, out: object, sizes: "ParallelSizes", ctx: "RunContext", model_only: bool = False
    ) -> tuple[list[str], list[str]]:
        """`--to tp=..,pp=..[,ep=..][,dp=..]`: the checkpoint chunked as MCore saves it at that layout
        (a save root or an iteration folder, as the source is), and notes on what was left out."""
        target = target_plan.plan(opened, sizes, model_only)
        return self.write(target, out, ctx), target_plan.notes(target, opened.index)


MCORE = McoreFormat()

__all__ = ["MCORE", "McoreFormat"]
