"""The DeepSpeed format's adapter: a ZeRO save folder (`latest`, mp_rank/zero_pp_rank files)
read, written and resharded in the one shape the registry and the operations use
(formats/protocols.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...index.types import CheckpointIndex, Replica
from ...storage.source import Source
from ..protocols import (
    ANY_WORLD,
    TO_PARALLEL_SIZES,
    ZERO_PARTITIONS,
    Capabilities,
    StepFolders,
    ZeroStateTarget,
    ZeroTarget,
    IndexReader,
    ReadOptions,
)
from . import files as ds_files
from . import reader as ds_reader
from .layout import LAYER_FILES, DeepSpeedLayout
from .names import parse_step_tag, step_tag
from .refusals import refuse_pipeline_reshard
from .read import read_index
from .resharding import write_at_world_size, write_resharded
from .state_target import write_state

if TYPE_CHECKING:
    from ...context import RunContext
    from ...index.parallel_spec import ParallelSizes


def replicas_of(index: CheckpointIndex) -> dict[str, list[Replica]]:
    """The copies the model-parallel layouts save of one tensor (tp ranks' replicated tensors,
    pipeline stages' tied modules), that verify --deep compares; none for the others."""
    layout = DeepSpeedLayout.of(index)
    if layout.tp == 1 and layout.stages != LAYER_FILES:
        return {}
    return {key: [Replica(what, e) for what, e in copies] for key, copies in index.native.replica_entries().items()}


class DeepSpeedFormat(IndexReader):
    name = "deepspeed"
    capabilities = Capabilities(
        layouts=(ZERO_PARTITIONS,),
        world_sizes=ANY_WORLD,
        optimizer_state=True,
        reshards=True,
        flat_partitions=True,
        tags=True,
        reshard_targets=(TO_PARALLEL_SIZES,),
        own_keys=frozenset(ds_reader.DS_KEYS | ds_reader.STRUCTURAL_KEYS),
        step_folders=StepFolders(name=step_tag, step_of=parse_step_tag),  # global_stepN
    )

    def detect(self, source: Source, name: str | None = None, *, tag: str | None = None) -> bool:
        """A ZeRO save folder (`latest` or rank files), or a folder whose --tag subfolder holds rank files."""
        if name is not None or not source.isdir(""):
            return False
        tag_folder = tag is not None and source.isdir(tag) and ds_files.looks_like_tag_folder(source.listdir(tag))
        return ds_files.detect(source) or tag_folder

    def read(self, source: Source, options: ReadOptions) -> CheckpointIndex:
        """`optimizer` False: the optimizer's per-parameter state may be counted, not indexed (read.read_index)."""
        index = read_index(
            source, options.tag, optimizer=options.optimizer
        )  # every layout: cells joined over ep, pp, tp
        index.replicas = replicas_of(index)
        return index

    def refuse_relayout(self, where: str, index: CheckpointIndex) -> None:
        """A pipeline source (alone or with tp) is rewritten by `reshard --to pp=...,dp=...` only."""
        refuse_pipeline_reshard(where, index)

    def write(self, target: ZeroTarget | ZeroStateTarget, out: object, ctx: "RunContext") -> list[str]:
        """ZeroTarget: a ZeRO checkpoint's own files for a new world size (with its helper scripts);
        ZeroStateTarget: convert's target, a training state laid out by a DeepSpeed config
        (state_target.py names and writes its files)."""
        if isinstance(target, ZeroStateTarget):
            return write_state(target, out, ctx)
        return write_at_world_size(out, target.index, target.source, target.world_size, ctx=ctx)

    def reshard(self, opened: Any, out: object, world_size: int, ctx: "RunContext") -> list[str]:
        """`--to N`: the writer of the source's layout family (resharding.py) keeps its
        model-parallel sizes."""
        return write_resharded(out, opened.index, opened.source, world_size, ctx=ctx)

    def reshard_parallel(self, opened: Any, out: object, sizes: "ParallelSizes", ctx: "RunContext") -> list[str]:
        """`--to tp=..,pp=..,ep=..,dp=..`: the writer of the source's layout family lays it out."""
        return write_resharded(out, opened.index, opened.source, sizes, ctx=ctx)


DEEPSPEED = DeepSpeedFormat()


def detect_layout(source: Source, tag: str | None = None) -> DeepSpeedLayout:
    """The layout of the checkpoint in `source` (tag `tag`, else `latest`'s), read from its files:
    the tag folder's names and the records the readers take the sizes from."""
    return DeepSpeedLayout.of(DEEPSPEED.read_index(source, tag=tag, optimizer=False))


__all__ = ["DEEPSPEED", "DeepSpeedFormat", "detect_layout", "replicas_of"]
