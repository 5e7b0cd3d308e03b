"""Shared helpers for the DeepSpeed tests: fixture discovery and truth-key mapping."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import DATA

DS_DATA = DATA / "deepspeed"


def ds_fixtures() -> list[str]:
    return sorted(p.name for p in DS_DATA.iterdir() if p.is_dir()) if DS_DATA.exists() else []


def fixture_info(name: str) -> dict:
    return json.loads((DS_DATA / name / "fixture.json").read_text())


def has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


needs_deepspeed = pytest.mark.skipif(
    not has_deepspeed(), reason="needs the deepspeed package (pip install -e '.[deepspeed]')"
)


def truth_key(kind: str, name: str) -> str | None:
    """The ckptkit index key holding what DeepSpeed's API returned for (kind, param name)."""
    return {
        "fp32": f"model.{name}",
        "exp_avg": f"optim.state.{name}.exp_avg",
        "exp_avg_sq": f"optim.state.{name}.exp_avg_sq",
        "frozen": f"model.{name}",
        "buffer": f"model.{name}",
        "module": f"ds_module.{name}",
    }.get(kind)
