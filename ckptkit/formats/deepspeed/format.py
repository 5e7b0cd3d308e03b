"""The DeepSpeed format's adapter: a ZeRO save folder (`latest`, mp_rank/zero_pp_rank files)
read, written and resharded in the one shape the registry and the operations use
(formats/protocols.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import UnsupportedError
from ...index.types import CheckpointIndex
from ...storage.source import Source
from ..protocols import ANY_WORLD, ZERO_PARTITIONS, Capabilities, ZeroTarget, ZeroTemplatesTarget
from . import files as ds_files
from . import pipeline as ds_pipeline
from . import pipeline_tp_writer as ds_3d_writer
from . import pipeline_writer as ds_pp_writer
from . import moe as ds_moe
from . import moe_pipeline_writer as ds_moe_pp_writer
from . import moe_tp_writer as ds_moe_tp_writer
from . import moe_whole_writer as ds_moe_whole_writer
from . import reader as ds_reader
from .moe_writer import write_moe_zero
from . import tp_writer as ds_tp_writer
from .writer import write_zero, write_zero_files

if TYPE_CHECKING:
    from ...context import RunContext
    from ...index.parallel_spec import ParallelSizes


class DeepSpeedFormat:
    name = "deepspeed"
    capabilities = Capabilities(
        layouts=(ZERO_PARTITIONS,),
        world_sizes=ANY_WORLD,
        optimizer_state=True,
        reshards=True,
        flat_partitions=True,
        tags=True,
    )

    def detect(self, source: Source, name: str | None = None, *, tag: str | None = None) -> bool:
        """A ZeRO save folder (`latest` or rank files), or a folder whose --tag subfolder holds rank files."""
        if name is not None or not source.isdir(""):
            return False
        tag_folder = tag is not None and source.isdir(tag) and ds_files.looks_like_tag_folder(source.listdir(tag))
        return ds_files.detect(source) or tag_folder

    def read_index(
        self,
        source: Source,
        ctx: "RunContext | None" = None,
        *,
        name: str | None = None,
        tag: str | None = None,
        optimizer: bool = True,
    ) -> CheckpointIndex:
        """`optimizer` False: the optimizer's per-parameter state may be counted, not indexed (reader.read_index)."""
        if ds_pipeline.detect(source, tag):  # PipelineModule's per-layer files: one ZeRO checkpoint per stage
            return ds_pipeline.read_index(source, tag)
        return ds_reader.read_index(source, tag, optimizer=optimizer)

    def write(self, target: ZeroTarget | ZeroTemplatesTarget, out: object, ctx: "RunContext") -> list[str]:
        """ZeroTarget: a ZeRO checkpoint's own files for a new world size (with its helper scripts);
        ZeroTemplatesTarget: the files of templates built from a training state and a config."""
        if isinstance(target, ZeroTemplatesTarget):
            return write_zero_files(
                out,
                target.index,
                target.source,
                target.info,
                target.world_size,
                target.tag,
                target.sub_group_size,
                ctx=ctx,
            )
        if ds_moe.is_moe(target.index):  # experts keep the source's ep size (moe_writer.target_sizes)
            return write_moe_zero(out, target.index, target.source, target.world_size, ctx=ctx)
        return write_zero(out, target.index, target.source, target.world_size, ctx=ctx)

    def reshard(self, opened: Any, out: object, world_size: int, ctx: "RunContext") -> list[str]:
        if ds_3d_writer.is_pipeline_tp(opened.index):  # pipeline x tp: --to N keeps tp and pp
            return ds_3d_writer.write_3d_zero(out, opened.index, opened.source, world_size, ctx=ctx)
        if ds_pp_writer.is_pipeline(opened.index):  # --to N keeps the source's pp
            return ds_pp_writer.write_pp_zero(out, opened.index, opened.source, world_size, ctx=ctx)
        if ds_moe_pp_writer.is_pipeline_moe(opened.index):  # MoE in a PipelineModule: --to N keeps pp and ep
            return ds_moe_pp_writer.write_pipeline_moe_zero(out, opened.index, opened.source, world_size, ctx=ctx)
        if ds_moe_whole_writer.is_moe_whole_tp(opened.index):  # whole experts with tp: --to N keeps tp and ep
            return ds_moe_whole_writer.write_whole_experts(out, opened.index, opened.source, world_size, ctx=ctx)
        if ds_moe_tp_writer.is_moe_tp(opened.index):  # experts with tp: --to N keeps tp and ep
            return ds_moe_tp_writer.write_moe_tp_zero(out, opened.index, opened.source, world_size, ctx=ctx)
        if ds_tp_writer.is_tensor_parallel(opened.index):  # --to N keeps the source's tp
            return ds_tp_writer.write_tp_zero(out, opened.index, opened.source, world_size, ctx=ctx)
        return self.write(ZeroTarget(opened.index, opened.source, world_size), out, ctx)

    def reshard_parallel(self, opened: Any, out: object, sizes: "ParallelSizes", ctx: "RunContext") -> list[str]:
        """`--to tp=..,pp=..,ep=..,dp=..`: the writer of the source's kind lays it out."""
        index = opened.index
        if ds_3d_writer.is_pipeline_tp(index):  # pipeline x tp: tp=T,pp=P,dp=W
            return ds_3d_writer.write_3d_zero(out, index, opened.source, sizes, ctx=ctx)
        if ds_pp_writer.is_pipeline(index):  # pipeline: pp=P,dp=W (tp 1)
            return ds_pp_writer.write_pp_zero(out, index, opened.source, sizes, ctx=ctx)
        if ds_moe_pp_writer.is_pipeline_moe(index):  # MoE in a PipelineModule: pp=P (the source's),ep=E,dp=W
            return ds_moe_pp_writer.write_pipeline_moe_zero(out, index, opened.source, sizes, ctx=ctx)
        if ds_moe_whole_writer.is_moe_whole_tp(index):  # whole experts (no expert TP): tp=T,ep=E,dp=W
            return ds_moe_whole_writer.write_whole_experts(out, index, opened.source, sizes, ctx=ctx)
        if ds_moe_tp_writer.is_moe_tp(index):  # experts with tensor parallelism: tp=T,ep=E,dp=W
            return ds_moe_tp_writer.write_moe_tp_zero(out, index, opened.source, sizes, ctx=ctx)
        if ds_tp_writer.is_tensor_parallel(index):  # tensor parallel: tp=T,dp=W
            return ds_tp_writer.write_tp_zero(out, index, opened.source, sizes, ctx=ctx)
        if ds_moe.is_moe(index):  # mixture of experts: ep=E',dp=W'
            return write_moe_zero(out, index, opened.source, sizes, ctx=ctx)
        if sizes.tp == sizes.pp == sizes.ep == 1:  # dp alone: a world size
            return self.reshard(opened, out, sizes.dp, ctx)
        raise UnsupportedError(
            f"--to {sizes}: not supported yet for {index.root} (ep=... needs a mixture-of-experts "
            f"checkpoint; give a world size to reshard its data-parallel ranks)"
        )


DEEPSPEED = DeepSpeedFormat()

__all__ = ["DEEPSPEED", "DeepSpeedFormat"]
