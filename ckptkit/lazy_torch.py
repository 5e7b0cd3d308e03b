"""torch, imported on its first use.

Indexing a checkpoint and moving its bytes (inspect, verify, reshard, consolidate and convert
without a dtype cast) need no tensor library, and importing torch costs 1-2 s per command (more
with a cold page cache): a third of a multi-GB reshard. Modules on those paths write

    if TYPE_CHECKING:
        import torch
    else:
        from ..lazy_torch import torch

and the name becomes the real module at the first attribute access. Code that only has to
recognise a tensor asks `is_tensor(x)` first: no tensor exists before torch is imported.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


class _LazyTorch:
    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch"), name)

    def __repr__(self) -> str:
        return "<torch, imported on first use>"


torch: Any = _LazyTorch()


def is_instance(value: Any, name: str) -> bool:
    """isinstance(value, torch.<name>), without importing torch to find out: no torch object
    exists before torch is imported (another thread may be importing it right now, so the
    class is looked up, not assumed)."""
    cls = getattr(sys.modules.get("torch"), name, None)
    return cls is not None and isinstance(value, cls)


def is_tensor(value: Any) -> bool:
    """isinstance(value, torch.Tensor), without importing torch to find out."""
    return is_instance(value, "Tensor")
