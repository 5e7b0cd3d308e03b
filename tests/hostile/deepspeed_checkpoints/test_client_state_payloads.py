"""Hostile client state inside real DeepSpeed model and optimizer files (huge bytearrays, shared or
deeply nested lists, structured numpy arrays) is refused by consolidate in one sentence.

Each case is crafted here as an attacker would, run through the CLI in a subprocess
(tests/helpers/hostile.py) and held to the whole contract.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers.hostile import Scene, check_refused, rss_bound, run_ckptkit

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fixtures" / "data"
TIMEOUT = 30.0


DS = DATA / "deepspeed" / "z1_fp32_w2"
MODEL_FILE = "global_step2/mp_rank_00_model_states.pt"
OPTIM_FILE = "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"


class _HugeBytearray:
    def __reduce__(self):  # the pickle calls bytearray(1.5e9): 8 bytes in the file
        return (bytearray, (1_500_000_000,))


def _shared_lists(levels: int = 40) -> list:
    x: list = []
    for _ in range(levels):
        x = [x, x]  # pickled once through the memo, 2**40 values when walked
    return x


def _nested(depth: int = 600) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def _structured_array():
    import numpy as np

    return np.zeros(4, dtype=[("a", "<i8"), ("b", "<f4")])


PAYLOADS = {
    "structured-numpy": (MODEL_FILE, _structured_array),
    "huge-bytearray": (OPTIM_FILE, _HugeBytearray),
    "shared-lists": (OPTIM_FILE, _shared_lists),
    "deep-nesting": (MODEL_FILE, _nested),
}


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_hostile_client_state_in_a_deepspeed_file_is_refused_by_consolidate(tmp_path: Path, payload: str) -> None:
    import sys

    import torch

    rel, make = PAYLOADS[payload]
    src = tmp_path / "src"
    shutil.copytree(DS, src)
    target = src / rel
    obj = torch.load(target, weights_only=False)  # the fixture is trusted; the crafted copy is not
    obj["client_state_hostile"] = make()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        torch.save(obj, target)
    finally:
        sys.setrecursionlimit(limit)
    out = tmp_path / "out"
    scene = Scene(src, out)
    run = run_ckptkit("consolidate", src, out, "--memory-budget", str(64 << 20), timeout=TIMEOUT)
    check_refused(run, str(target), scene=scene, rss_limit=rss_bound(64 << 20, target.stat().st_size))
