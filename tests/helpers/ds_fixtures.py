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


def assert_same_pickled(a, b, where: str) -> None:
    """Two unpickled DeepSpeed structures equal object for object (tensors bit for bit)."""
    import torch

    from conftest import assert_tensor_equal

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert_tensor_equal(b, a, where)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for k in a:
            assert_same_pickled(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_pickled(x, y, f"{where}[{i}]")
    elif type(a).__name__ == "fragment_address":
        assert type(b).__name__ == "fragment_address" and (a.numel, a.start) == (b.numel, b.start), where
    else:
        assert type(a) is type(b) and repr(a) == repr(b), where
