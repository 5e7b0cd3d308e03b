"""The DeepSpeed universal checkpoint's adapter: ds_to_universal's folder (one folder of whole
fp32 masters and optimizer states per parameter, which DeepSpeed loads at any dp with
`"checkpoint": {"load_universal": true}`), read and written in the one shape the registry and the
operations use (formats/protocols.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...index.types import CheckpointIndex
from ...storage.source import Source
from ..protocols import ONE_WORLD, WHOLE_TENSORS, Capabilities, CannotReshard, IndexReader, ReadOptions
from . import reader as uc_reader
from .layout import LATEST_UNIVERSAL, is_tag_folder

if TYPE_CHECKING:
    from ...context import RunContext
    from .writer import UniversalTarget


class DsUniversalFormat(IndexReader, CannotReshard):
    name = "ds_universal"
    # flat_partitions: the training state comes from DeepSpeed's own records (roles, param groups,
    # its Adam's int steps), as a ZeRO checkpoint's does; its tensors are whole
    capabilities = Capabilities(
        layouts=(WHOLE_TENSORS,),
        world_sizes=ONE_WORLD,
        optimizer_state=True,
        reshards=False,
        flat_partitions=True,
        tags=True,
        own_keys=uc_reader.OWN_KEYS,
    )

    def detect(self, source: Source, name: str | None = None, *, tag: str | None = None) -> bool:
        """A universal tag folder (zero/optimizer_state.pt beside a model-states file), a folder
        whose `latest_universal` (or --tag) names one."""
        if name is not None or not source.isdir(""):
            return False
        if tag is not None:
            return source.isdir(tag) and is_tag_folder(source, tag)
        names = source.listdir("")
        return is_tag_folder(source, "") or (LATEST_UNIVERSAL in names and not source.isdir(LATEST_UNIVERSAL))

    def read(self, source: Source, options: ReadOptions) -> CheckpointIndex:
        return uc_reader.read_index(source, options.tag)

    def write(self, target: "UniversalTarget", out: object, ctx: "RunContext") -> list[str]:
        from .writer import write_universal

        return write_universal(target, out, ctx)


DS_UNIVERSAL = DsUniversalFormat()

__all__ = ["DS_UNIVERSAL", "DsUniversalFormat"]
