"""The torch.save format's adapter: one zip archive (.pt, .pth, .bin, .ckpt, .tar) read and
written in the one shape the registry and the operations use (formats/protocols.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...index.types import CheckpointIndex
from ...runner.torch_archive import ZIP_MAGIC
from ...storage.source import Source
from ..protocols import ONE_WORLD, WHOLE_TENSORS, Capabilities, CannotReshard, TorchSaveTarget, IndexReader, ReadOptions
from . import reader as ts_reader
from .writer import write_torch_save

if TYPE_CHECKING:
    from ...context import RunContext

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


class TorchSaveFormat(IndexReader, CannotReshard):
    name = "torch_save"
    capabilities = Capabilities(
        layouts=(WHOLE_TENSORS,), world_sizes=ONE_WORLD, optimizer_state=True, reshards=False, suffixes=TORCH_SUFFIXES
    )

    def detect(self, source: Source, name: str | None = None, *, tag: str | None = None) -> bool:
        """A zip archive; a folder holding exactly one torch.save file (several: which is meant is unsaid)."""
        if name is not None:
            return source.read(name, 0, min(4, source.size(name))) == ZIP_MAGIC
        return len(torch_files(source)) == 1

    def read(self, source: Source, options: ReadOptions) -> CheckpointIndex:
        name = options.name
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


def torch_files(source: Source) -> list[str]:
    return [n for n in source.listdir("") if n.endswith(TORCH_SUFFIXES)]


TORCH_SAVE = TorchSaveFormat()

__all__ = ["TORCH_SAVE", "TORCH_SUFFIXES", "TorchSaveFormat", "torch_files"]
