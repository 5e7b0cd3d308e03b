"""One Reader/Writer adapter per format (formats/protocols.py), over each package's own functions.

The packages (dcp/, deepspeed/, torch_save/, safetensors/) keep their natural signatures; these
adapters give them the one shape the registry and the operations use, and declare what each
format's writer can produce. The folder kinds around them (accelerate, HF Trainer, Lightning, run
folders) are resolvers in registry.py: they find one of these formats inside a folder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..errors import UnsupportedError, UsageError

from ..index.layouts import fsdp2_layout
from ..index.types import CheckpointIndex
from ..runner.fetch import Fetcher
from ..storage.source import Source
from .dcp import reader as dcp_reader
from .dcp.writer import write_dcp
from .deepspeed import files as ds_files
from .deepspeed import pipeline as ds_pipeline
from .deepspeed import pipeline_tp_writer as ds_3d_writer
from .deepspeed import pipeline_writer as ds_pp_writer
from .deepspeed import moe as ds_moe
from .deepspeed import moe_pipeline_writer as ds_moe_pp_writer
from .deepspeed import moe_tp_writer as ds_moe_tp_writer
from .deepspeed import moe_whole_writer as ds_moe_whole_writer
from .deepspeed import reader as ds_reader
from .deepspeed.moe_writer import write_moe_zero
from .deepspeed import tp_writer as ds_tp_writer
from .deepspeed.writer import write_zero, write_zero_files
from .protocols import (
    ANY_WORLD,
    FSDP2_SHARDS,
    ONE_WORLD,
    WHOLE_TENSORS,
    ZERO_PARTITIONS,
    Capabilities,
    DcpTarget,
    OutTensor,
    SafetensorsTarget,
    TorchSaveTarget,
    ZeroTarget,
    ZeroTemplatesTarget,
)
from .safetensors import reader as st_reader
from .safetensors.writer import plan_shards, write_safetensors
from .torch_save import reader as ts_reader
from ..runner.torch_archive import ZIP_MAGIC
from .torch_save.writer import write_torch_save

if TYPE_CHECKING:
    from ..context import RunContext
    from ..index.parallel_spec import MeshSpec, ParallelSizes

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


class _CannotReshard:
    """A format whose output is one whole copy: there is nothing laid out per rank to redo."""

    name: str

    def reshard(self, opened: Any, out: object, world_size: int, ctx: "RunContext") -> list[str]:
        raise NotImplementedError(f"{self.name} is not laid out by world size (capabilities.reshards is False)")


class DcpFormat:
    name = "dcp"
    capabilities = Capabilities(
        layouts=(FSDP2_SHARDS, WHOLE_TENSORS),
        world_sizes=ANY_WORLD,
        optimizer_state=True,
        reshards=True,
        recipe_keys=True,
    )

    def detect(self, source: Source, name: str | None = None) -> bool:
        return name is None and dcp_reader.detect(source)

    def read_index(
        self, source: Source, ctx: "RunContext | None" = None, *, name: str | None = None, tag: str | None = None
    ) -> CheckpointIndex:
        return dcp_reader.read_index(source)

    def write(self, target: DcpTarget, out: object, ctx: "RunContext") -> list[str]:
        return write_dcp(out, target.index, target.fetcher, target.layout, source=target.source, ctx=ctx)

    def reshard(self, opened: Any, out: object, world_size: int, ctx: "RunContext") -> list[str]:
        index = opened.index
        return self.write(
            DcpTarget(index, Fetcher(opened.source), fsdp2_layout(index, world_size), opened.source), out, ctx
        )

    def reshard_mesh(
        self,
        opened: Any,
        out: object,
        mesh: "MeshSpec",
        ctx: "RunContext",
        *,
        source_mesh: "MeshSpec | None" = None,
        tp_dim_for: "Callable[[str, tuple[int, ...]], int | None] | None" = None,
    ) -> tuple[list[str], str]:
        """DCP on a device mesh (FSDP2, HSDP, + TP), chunk for chunk as torch's dcp.save writes it;
        also says which source mesh the placements were read under."""
        from ..index import mesh as meshes
        from ..index.parallel_spec import MeshSpec

        index = opened.index
        if source_mesh is None:
            try:
                source_mesh, placements = meshes.infer_source_mesh(index)
                how = "inferred"
            except UnsupportedError:  # not torch's chunks for any mesh: no tp split to keep
                placements = meshes.placements_by_role(index)
                source_mesh = MeshSpec((("dp_shard", index.world_size or 1),))
                how = "its chunks fit no mesh: parameters are those with optimizer state or split chunks, no tp"
        else:
            if source_mesh.world_size != (index.world_size or 1):
                raise UsageError(
                    f"{index.root}: was saved by {index.world_size} ranks, --from {source_mesh} has "
                    f"{source_mesh.world_size}"
                )
            found = meshes.source_placements(index, source_mesh)
            if found is None:
                raise UnsupportedError(
                    f"{index.root}: its chunks are not what FSDP2/HSDP/TP on {source_mesh} writes (check --from)"
                )
            placements, how = found, "given"
        target = meshes.target_placements(index, placements, source_mesh, mesh, tp_dim_for)
        layout = meshes.mesh_layout(index, mesh, target, dcp_reader.state_dict_order(opened.source))
        files = self.write(DcpTarget(index, Fetcher(opened.source), layout, opened.source), out, ctx)
        return files, f"source {source_mesh} ({how})"


class DeepSpeedFormat:
    name = "deepspeed"
    capabilities = Capabilities(
        layouts=(ZERO_PARTITIONS,), world_sizes=ANY_WORLD, optimizer_state=True, reshards=True, flat_partitions=True
    )

    def detect(self, source: Source, name: str | None = None) -> bool:
        return name is None and ds_files.detect(source)

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


class TorchSaveFormat(_CannotReshard):
    name = "torch_save"
    capabilities = Capabilities(layouts=(WHOLE_TENSORS,), world_sizes=ONE_WORLD, optimizer_state=True, reshards=False)

    def detect(self, source: Source, name: str | None = None) -> bool:
        if name is not None:
            return source.read(name, 0, min(4, source.size(name))) == ZIP_MAGIC
        return (
            not dcp_reader.detect(source)
            and not ds_files.detect(source)  # one file, no other checkpoint
            and not st_reader.safetensors_files(source)
            and len(torch_files(source)) == 1
        )

    def read_index(
        self, source: Source, ctx: "RunContext | None" = None, *, name: str | None = None, tag: str | None = None
    ) -> CheckpointIndex:
        return ts_reader.read_index(source, name if name is not None else torch_files(source)[0])

    def write(self, target: TorchSaveTarget, out: object, ctx: "RunContext") -> list[str]:
        write_torch_save(
            out,
            target.name,
            target.index,
            target.fetcher,
            ctx=ctx,
            keys=target.keys,
            include_objects=target.include_objects,
            key_map=target.key_map,
        )
        return [target.name]


class SafetensorsFormat(_CannotReshard):
    name = "safetensors"
    capabilities = Capabilities(
        layouts=(WHOLE_TENSORS,), world_sizes=ONE_WORLD, optimizer_state=False, reshards=False, library_check=True
    )

    def detect(self, source: Source, name: str | None = None) -> bool:
        if name is not None:
            return source.read(name, 0, min(4, source.size(name))) != ZIP_MAGIC and looks_like_safetensors(source, name)
        return (
            not dcp_reader.detect(source) and not ds_files.detect(source) and bool(st_reader.safetensors_files(source))
        )

    def read_index(
        self, source: Source, ctx: "RunContext | None" = None, *, name: str | None = None, tag: str | None = None
    ) -> CheckpointIndex:
        return st_reader.read_index(source, [name] if name is not None else st_reader.safetensors_files(source))

    def write(self, target: SafetensorsTarget, out: object, ctx: "RunContext") -> list[str]:
        return write_safetensors(
            out,
            target.fetcher,
            target.tensors,
            basename=target.basename,
            max_shard_bytes=target.max_shard_bytes,
            aliases=target.aliases,
            objects=target.objects,
            ctx=ctx,
        )

    def shard_count(self, tensors: list[OutTensor], max_shard_bytes: int) -> int:
        """How many files `tensors` take with shards of at most `max_shard_bytes` (1: one file)."""
        return len(plan_shards(tensors, max_shard_bytes))


def torch_files(source: Source) -> list[str]:
    return [n for n in source.listdir("") if n.endswith(TORCH_SUFFIXES)]


def looks_like_safetensors(source: Source, name: str) -> bool:
    """An 8-byte little-endian header length that fits the file, then a JSON object."""
    size = source.size(name)
    if size < 10:
        return False
    n = int.from_bytes(source.read(name, 0, 8), "little")
    return 0 < n <= size - 8 and source.read(name, 8, 1) == b"{"


DCP, DEEPSPEED, TORCH_SAVE, SAFETENSORS = DcpFormat(), DeepSpeedFormat(), TorchSaveFormat(), SafetensorsFormat()

__all__ = ["DCP", "DEEPSPEED", "TORCH_SAVE", "SAFETENSORS", "TORCH_SUFFIXES", "torch_files", "looks_like_safetensors"]
