"""Training-loop hooks. Imported lazily: the Checkpointer imports torch (`ckptkit inspect DIR`
reads a Checkpointer directory through ops/inspect_steps.py, without it)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "Checkpointer",
    "SkippedStepsWarning",
    "DuplicateStepError",
    "RngNotRestoredWarning",
    "StateChangedError",
]


def __getattr__(name: str) -> Any:
    if name in ("Checkpointer", "SkippedStepsWarning"):
        from . import checkpointer

        return getattr(checkpointer, name)
    if name == "DuplicateStepError":
        from .steps import DuplicateStepError

        return DuplicateStepError
    if name == "StateChangedError":
        from .staging import StateChangedError

        return StateChangedError
    if name == "RngNotRestoredWarning":
        from .rng import RngNotRestoredWarning

        return RngNotRestoredWarning
    raise AttributeError(f"module 'ckptkit.hooks' has no attribute {name!r}")
