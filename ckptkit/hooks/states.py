"""The `states=` of Checkpointer.save/restore: named objects with state_dict()/load_state_dict().

Anything with both methods is taken (an LR scheduler, torchdata's StatefulDataLoader, a sampler
that keeps its position, a counter). torch's own DataLoader has neither: its position lives in an
iterator it does not expose, so it is refused with what to pass instead, never saved as if it
could be resumed.
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError, UsageError

DATALOADER_WHY = (
    "torch's DataLoader has no state_dict() and load_state_dict(): its position is in an iterator "
    "it does not expose, so it cannot be resumed; pass torchdata's StatefulDataLoader (a drop-in "
    "replacement that saves its position, sampler and generator), or a sampler that keeps its "
    "own position (state_dict()/load_state_dict()) under its own name"
)


def _is_torch_dataloader(obj: Any) -> bool:
    try:
        from torch.utils.data import DataLoader
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(obj, DataLoader)


def validate(states: dict[str, Any]) -> None:
    """Refuse, before anything is written or loaded, what cannot be a `states` entry."""
    if not isinstance(states, dict):
        raise UsageError(f"states must be a dict of name -> object (got {type(states).__name__})")
    for name, obj in states.items():
        if not isinstance(name, str) or not name or "." in name:
            raise UsageError(f"states: names are non-empty strings without dots (got {name!r:.60})")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            if _is_torch_dataloader(obj):
                raise UsageError(f"states[{name!r}]: {DATALOADER_WHY}")
            raise UsageError(f"states[{name!r}]: {type(obj).__name__} has no state_dict() and load_state_dict()")


def state_dicts(states: dict[str, Any] | None) -> dict[str, Any]:
    """Each named object's state_dict()."""
    validate(states or {})
    return {name: obj.state_dict() for name, obj in (states or {}).items()}


def check_states(path: str, states: dict[str, Any], saved: dict) -> None:
    validate(states)
    missing = [k for k in states if k not in saved]
    if missing:
        have = ", ".join(sorted(map(str, saved))) or "none"
        raise FormatError(f"{path}: holds no state {missing[0]!r} (states saved: {have})")


def refuse_other_keys(value: Any, where: str) -> None:
    """DCP flattens nested dicts into dotted names, so a key that is no str (1, (0, 1), None)
    would come back from restore as its text ('1'): refused before anything is written."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, str):
                    raise UsageError(
                        f"{at}: key {key!r:.60} is a {type(key).__name__}; a checkpoint's "
                        f"dict keys must be str (DCP joins them into dotted names, so restore "
                        f"would give back {str(key)!r:.60})"
                    )
                stack.append((inner, f"{at}[{key!r:.60}]"))
        elif isinstance(item, (list, tuple)):
            stack.extend((inner, f"{at}[{i}]") for i, inner in enumerate(item))


__all__ = ["validate", "state_dicts", "check_states", "refuse_other_keys", "DATALOADER_WHY"]
