"""Deprecated name: `RunOptions` is ckptkit.context.RunContext (kept for `options=` callers)."""

from __future__ import annotations

from ..context import RunContext

RunOptions = RunContext

__all__ = ["RunOptions"]
