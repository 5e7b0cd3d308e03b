"""The memory budget in force where no RunContext reaches: reads made while indexing (a DCP
value item decompressed and unpickled whole) and Fetchers built without an explicit budget.

The CLI sets it from --memory-budget for its one command (`set_budget`); a library caller who
does not gets knobs.MEMORY_BUDGET (CKPTKIT_MEMORY_BUDGET).
"""

from __future__ import annotations

from .. import knobs

_budget: int | None = None


def set_budget(nbytes: int | None) -> None:
    """Make `nbytes` the budget of this process (None: back to knobs.MEMORY_BUDGET)."""
    global _budget
    _budget = nbytes


def budget() -> int:
    return _budget or knobs.MEMORY_BUDGET


def value_bytes(budget_bytes: int | None = None) -> int:
    """The most bytes one value loaded whole (a DCP bytes item) may decompress to: a quarter of
    the budget, as unpickling it holds the bytes and what they build at once."""
    return max(1 << 20, (budget_bytes or budget()) // 4)


def inline_bytes(budget_bytes: int | None = None) -> int:
    """The largest decoded tensor item held whole in memory; larger ones are streamed."""
    return max(1 << 20, knobs.slab_bytes(budget_bytes or budget()) // 2)
