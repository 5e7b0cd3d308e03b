"""The DCP format's adapter: torch.distributed.checkpoint folders (a .metadata file and its
.distcp data files) read, written and resharded in the one shape the registry and the
operations use (formats/protocols.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ...errors import UnsupportedError, UsageError
from ...index.layouts import fsdp2_layout
from ...index.types import CheckpointIndex
from ...runner.fetch import Fetcher
from ...storage.source import Source
from ..protocols import (
    ANY_WORLD,
    FSDP2_SHARDS,
    TO_MESH,
    WHOLE_TENSORS,
    Capabilities,
    DcpTarget,
    IndexReader,
    ReadOptions,
)
from . import reader as dcp_reader
from .writer import write_dcp

if TYPE_CHECKING:
    from ...context import RunContext
    from ...index.parallel_spec import MeshSpec


class DcpFormat(IndexReader):
    name = "dcp"
    capabilities = Capabilities(
        layouts=(FSDP2_SHARDS, WHOLE_TENSORS),
        world_sizes=ANY_WORLD,
        optimizer_state=True,
        reshards=True,
        recipe_keys=True,
        reshard_targets=(TO_MESH,),
        saved_key_order=dcp_reader.state_dict_order,
    )

    def detect(self, source: Source, name: str | None = None, *, tag: str | None = None) -> bool:
        return name is None and dcp_reader.detect(source)

    def read(self, source: Source, options: ReadOptions) -> CheckpointIndex:
        return dcp_reader.read_index(source)

    def refuse_relayout(self, where: str, index: CheckpointIndex) -> None:
        """Torch's chunks: the training state reads them whole, any layout can be made."""

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
        from ...index import mesh as meshes
        from ...index.parallel_spec import MeshSpec

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


DCP = DcpFormat()

__all__ = ["DCP", "DcpFormat"]
