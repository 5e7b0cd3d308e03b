"""Hugging Face accelerate's FSDP checkpoint folders: model and optimizer as two DCP folders.

`accelerator.save_state()` with SHARDED_STATE_DICT writes `pytorch_model_fsdp_0/` (DCP of
{"model": ...}) and `optimizer_0/` (DCP of {"optimizer": FSDP.optim_state_dict(...)}) next to
its scheduler and RNG files. Both are indexed and merged into one index whose file names are
relative to the outer folder, so every command reads them as one checkpoint.
"""

from __future__ import annotations

import dataclasses
import re

from ..index.types import CheckpointIndex
from ..storage.source import Source
from .dcp import reader as dcp_reader

# ASCII digits, and the whole name ("$" would also match before a trailing line break)
MODEL_DIR = re.compile(r"^pytorch_model_fsdp_([0-9]+)\Z", re.ASCII)
OPTIM_DIR = re.compile(r"^optimizer_([0-9]+)\Z", re.ASCII)
LOCAL_FILE = re.compile(r"^pytorch_model_fsdp(_[0-9]+)?_rank[0-9]+\.bin\Z", re.ASCII)


class SubSource:
    """A folder inside a source, seen as a source of its own."""

    def __init__(self, parent: Source, prefix: str) -> None:
        self.parent, self.prefix = parent, prefix.rstrip("/") + "/"
        self.root = parent.root.rstrip("/") + "/" + self.prefix.rstrip("/")

    def _p(self, rel: str) -> str:
        return self.prefix + rel if rel else self.prefix.rstrip("/")

    def size(self, rel: str) -> int:
        return self.parent.size(self._p(rel))

    def exists(self, rel: str) -> bool:
        return self.parent.exists(self._p(rel))

    def isdir(self, rel: str = "") -> bool:
        return self.parent.isdir(self._p(rel))

    def listdir(self, rel: str = "") -> list[str]:
        return self.parent.listdir(self._p(rel))

    def read(self, rel: str, offset: int, length: int) -> bytes:
        return self.parent.read(self._p(rel), offset, length)

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        self.parent.readinto(self._p(rel), offset, buf)

    def label(self, rel: str) -> str:
        return self.parent.label(self._p(rel))


def parts(source: Source) -> list[str]:
    """accelerate's DCP sub-folders (model first), or [] when this is not such a folder."""
    names = source.listdir("")
    found = sorted(
        n
        for n in names
        if (MODEL_DIR.match(n) or OPTIM_DIR.match(n)) and source.isdir(n) and dcp_reader.detect(SubSource(source, n))
    )
    return sorted(found, key=lambda n: (0 if MODEL_DIR.match(n) else 1, n))


def has_local_state_dict(source: Source) -> list[str]:
    return [n for n in source.listdir("") if LOCAL_FILE.match(n)]


def read_index(source: Source, subdirs: list[str]) -> CheckpointIndex:
    merged = CheckpointIndex(format="dcp", root=source.root)
    worlds = set()
    for sub in subdirs:
        index = dcp_reader.read_index(SubSource(source, sub))
        prefix = sub + "/"

        def moved(loc):
            return dataclasses.replace(loc, file=prefix + loc.file) if loc is not None else None

        for key, e in index.tensors.items():
            e.pieces = [dataclasses.replace(p, location=moved(p.location)) for p in e.pieces]
            merged.add_tensor(e)
        for key, o in index.objects.items():
            o.location = moved(o.location)
            merged.add_object(o)
        merged.files.update({prefix + k: v for k, v in index.files.items()})
        merged.checks.extend(c._replace(file=prefix + c.file) for c in index.checks)
        if index.world_size:
            worlds.add(index.world_size)
    merged.world_size = max(worlds) if worlds else None
    merged.metadata["accelerate"] = subdirs
    return merged
