"""Two entries whose paths join to one name ({"a.b": x, "a": {"b": y}}) are refused by name by
inspect, consolidate and convert, never merged with one hiding the other.

Each case is crafted here as an attacker would, run through the CLI in a subprocess
(tests/helpers/hostile.py) and held to the whole contract.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.hostile import Scene, check_refused, run_ckptkit


@pytest.mark.parametrize("cmd", ["inspect", "consolidate", "convert"])
def test_two_entries_that_flatten_to_one_name_are_refused_not_merged(tmp_path: Path, cmd: str) -> None:
    """{"a.b": x, "a": {"b": y}}: both join to the name "a.b". Kept silently, one hid the other
    (inspect counted 1 tensor, convert wrote one of them, exit 0)."""
    import torch

    src = tmp_path / "two.pt"
    torch.save({"model": {"a.b": torch.ones(3), "a": {"b": torch.zeros(3)}}}, src)
    out = tmp_path / "out"
    scene = Scene(src, out if cmd != "inspect" else None)
    extra = {"inspect": [], "consolidate": [str(out)], "convert": [str(out), "--to", "torch"]}[cmd]
    run = run_ckptkit(cmd, src, *extra)
    check_refused(run, str(src), "same name", "model.a.b", scene=scene)
