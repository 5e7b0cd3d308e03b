"""ckptkit: read, verify, consolidate, reshard and convert sharded training checkpoints.

In-job API (imported lazily, so the command line starts fast):
    ckptkit.save(state_dict, path)       collective DCP save, committed atomically
    ckptkit.load(state_dict, path)       fill a (sharded) state dict from any checkpoint format
    ckptkit.Checkpointer(directory, keep=3, async_save=False)
    ckptkit.StorageReader(path)          torch's dcp.load reading any checkpoint format
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported: `python -m ckptkit` runs this before its Ctrl-C handler
if TYPE_CHECKING:
    from typing import Any

__all__ = ["save", "load", "Checkpointer", "StorageReader"]


def __getattr__(name: str) -> Any:
    if name in ("save", "load"):
        from . import api

        return getattr(api, name)
    if name == "Checkpointer":
        from .hooks.checkpointer import Checkpointer

        return Checkpointer
    if name == "StorageReader":
        from .hooks.storage_reader import StorageReader

        return StorageReader
    raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")
