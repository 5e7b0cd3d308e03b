"""Flat keys for nested state dicts, following torch.distributed.checkpoint (torch >= 2.4).

Mappings always recurse (keys become strings); lists recurse only when they hold tensors or
non-terminal containers; tuples and everything else are leaves. The key is ".".join(path).
Nesting is rebuilt from the path, never by splitting keys on ".".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

Path = tuple[Any, ...]


def key_of(path: Path) -> str:
    return ".".join(str(p) for p in path)


def flatten(state: Mapping, is_tensor: Callable[[Any], bool]) -> list[tuple[Path, Any]]:
    """Leaves of a nested state dict as (path, value), in traversal order."""
    out: list[tuple[Path, Any]] = []

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        for entry in value:
            if isinstance(entry, (Mapping, list)) and not terminal(entry):
                return False
            if is_tensor(entry):
                return False
        return True

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(path + (str(k),), v)
        elif terminal(value):
            out.append((path, value))
        else:
            for i, v in enumerate(value):
                visit(path + (i,), v)

    for key, value in state.items():
        visit((str(key),), value)
    return out


def unflatten(items: list[tuple[Path, Any]]) -> dict:
    """Rebuild nesting from paths; int path elements index lists."""
    root: dict = {}
    for path, value in items:
        node: Any = root
        for i, part in enumerate(path[:-1]):
            nxt_is_list = isinstance(path[i + 1], int)
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = [] if nxt_is_list else {}
                node = node[part]
            else:
                if part not in node:
                    node[part] = [] if nxt_is_list else {}
                node = node[part]
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
            node[last] = value
        else:
            node[last] = value
    return root
