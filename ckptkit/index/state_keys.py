"""Canonical names of model and optimizer entries (torch's recipe), built in one place.

Readers, writers and convert all name a parameter's master `model.<name>` and its optimizer
state `optim.state.<name>.<key>`; the path keeps the nesting, since names contain dots.
"""

from __future__ import annotations

from typing import Any


def model_key(name: str) -> str:
    return f"model.{name}"


def model_path(name: str) -> tuple[str, str]:
    return ("model", name)


def state_key(name: str, key: Any) -> str:
    """`optim.state.<name>.<key>`: one optimizer state value of parameter `name`."""
    return f"optim.state.{name}.{key}"


def state_path(name: str, key: Any) -> tuple[str, str, str, Any]:
    return ("optim", "state", name, key)


def param_group_key(group: int, hyper: str) -> str:
    """`optim.param_groups.<g>.<hyper>`: one hyperparameter of param group `group`."""
    return f"optim.param_groups.{group}.{hyper}"


def param_group_path(group: int, hyper: str) -> tuple[str, str, int, str]:
    return ("optim", "param_groups", group, hyper)
