"""The vocabulary of the unpickler's grammar, shared by safeload.grammar and safeload.numpy: a Rule
checks a call's arguments, Refused says they are outside the grammar, and formats add their own
stand-ins to the allowlist with register_allowed.
"""

from __future__ import annotations

from typing import Any, Callable

Rule = Callable[[tuple], Any]


class Refused(Exception):
    """Raised by a rule: the arguments are outside the grammar (the caller names the global)."""


_EXTRA: dict[tuple[str, str], Any] = {}


def register_allowed(module: str, name: str, value: Any) -> None:
    """Let a format add inert stand-ins for its own classes (e.g. DeepSpeed's loss scaler): an
    Inert subclass may be called and built like the DCP classes; any other value is data only."""
    _EXTRA[(module, name)] = value


def extra_allowed() -> dict[tuple[str, str], Any]:
    return dict(_EXTRA)


def pickle_account(nbytes: int) -> int:
    """The bytes unpickling `nbytes` of pickle may cause to be allocated, all charged to one
    account: the memory budget of this process (--memory-budget, CKPTKIT_MEMORY_BUDGET), or twice
    the pickle's size where that is more (the promise of docs/reliability.md)."""
    from ..runner import limits  # (foundation: the budget a CLI command set)

    return max(limits.budget(), 2 * nbytes)
