"""The npy format's adapter: the only thing ckptkit is told about it (registry.register(NPY)).

A folder of .npy files (one tensor each, named by its key) or one .npy file, read and written
whole; the same Reader/Writer contract as ckptkit's own formats (ckptkit/formats/protocols.py)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptkit.formats.protocols import ONE_WORLD, WHOLE_TENSORS, CannotReshard, Capabilities
from ckptkit.index.types import CheckpointIndex
from ckptkit.storage.source import Source

from . import reader


@dataclass(frozen=True)
class NpyTarget:
    index: CheckpointIndex
    fetcher: Any  # ckptkit.runner.fetch.Fetcher over the index's source


class NpyFormat(CannotReshard):
    name = reader.FORMAT
    capabilities = Capabilities(
        layouts=(WHOLE_TENSORS,),
        world_sizes=ONE_WORLD,
        optimizer_state=False,
        reshards=False,
        recipe_keys=True,  # its keys are the state dict's own (ckptkit.load reads it as is)
        suffixes=(reader.SUFFIX,),
    )

    def detect(self, source: Source, name: str | None = None, *, tag: str | None = None) -> bool:
        if name is not None:
            return reader.is_npy(source, name)
        files = reader.npy_files(source)
        return bool(files) and all(reader.is_npy(source, n) for n in files)

    def read_index(
        self,
        source: Source,
        ctx: Any = None,
        *,
        name: str | None = None,
        tag: str | None = None,
        optimizer: bool = True,
    ) -> CheckpointIndex:
        return reader.read_index(source, [name] if name is not None else reader.npy_files(source))

    def write(self, target: NpyTarget, out: Any, ctx: Any) -> list[str]:
        written = []
        for key, entry in target.index.tensors.items():
            buf = io.BytesIO()
            np.save(buf, target.fetcher.fetch(entry).numpy(), allow_pickle=False)
            out.write_bytes(key + reader.SUFFIX, buf.getvalue())
            written.append(key + reader.SUFFIX)
        return written


NPY = NpyFormat()
