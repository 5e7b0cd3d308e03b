"""The safetensors format's adapter: *.safetensors files (one or sharded) read and written in
the one shape the registry and the operations use (formats/protocols.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...index.types import CheckpointIndex
from ...runner.torch_archive import ZIP_MAGIC
from ...storage.source import Source
from ..protocols import (
    ONE_WORLD,
    WHOLE_TENSORS,
    Capabilities,
    CannotReshard,
    OutTensor,
    SafetensorsTarget,
    IndexReader,
    ReadOptions,
)
from . import reader as st_reader
from .writer import plan_shards, write_safetensors

if TYPE_CHECKING:
    from ...context import RunContext


class SafetensorsFormat(IndexReader, CannotReshard):
    name = "safetensors"
    capabilities = Capabilities(
        layouts=(WHOLE_TENSORS,),
        world_sizes=ONE_WORLD,
        optimizer_state=False,
        reshards=False,
        library_check=True,
        suffixes=(".safetensors",),
    )

    def detect(self, source: Source, name: str | None = None, *, tag: str | None = None) -> bool:
        """A file with a safetensors header (never a zip archive); a folder of *.safetensors shards."""
        if name is not None:
            return source.read(name, 0, min(4, source.size(name))) != ZIP_MAGIC and looks_like_safetensors(source, name)
        return bool(st_reader.safetensors_files(source))

    def read(self, source: Source, options: ReadOptions) -> CheckpointIndex:
        name = options.name
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


def looks_like_safetensors(source: Source, name: str) -> bool:
    """An 8-byte little-endian header length that fits the file, then a JSON object."""
    size = source.size(name)
    if size < 10:
        return False
    n = int.from_bytes(source.read(name, 0, 8), "little")
    return 0 < n <= size - 8 and source.read(name, 8, 1) == b"{"


SAFETENSORS = SafetensorsFormat()

__all__ = ["SAFETENSORS", "SafetensorsFormat", "looks_like_safetensors"]
