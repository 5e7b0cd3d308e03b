"""megatron-core itself loads what `ckptkit reshard --to tp=..,pp=..` writes, into a model and
optimizer built at the new layout (fixtures/mcore_load_check.py, a real MCore job on CPU with
gloo), and saves them again: every tensor MCore saved (model and optimizer state) equals the
source's bit for bit, and ckptkit's chunks are the ones MCore's own save writes at that layout."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from click.testing import CliRunner

from ckptkit_cli.main import cli
from conftest import DATA
from helpers.mcore_dcp import chunks_by_rank, global_tensors

MCORE = DATA / "mcore"
ITER = "iter_0000002"
FIXTURES = DATA.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="megatron-core is not installed (pip install -e '.[test]' installs it)",
    ),
]


@pytest.mark.parametrize(
    ("name", "tp", "pp"),
    [
        ("tp2_swiglu_gqa", 1, 1),  # tp 2 -> 1 (SwiGLU, GQA)
        ("pp2_tied", 2, 1),  # pp 2 -> tp 2 (tied embedding)
        ("tp2dp2_distopt_full", 1, 2),  # tp 2 -> pp 2, the distributed optimizer fully_reshardable
    ],
)
def test_mcore_loads_the_reshard_into_a_model_and_optimizer_at_the_new_layout(tmp_path, name, tp, pp):
    out, resave = tmp_path / "out", tmp_path / "resave"
    run = CliRunner().invoke(cli, ["reshard", str(MCORE / name), str(out), "--to", f"tp={tp},pp={pp}"])
    assert run.exit_code == 0, run.output
    sys.path.insert(0, str(FIXTURES))
    try:
        import mcore_load_check
    finally:
        sys.path.remove(str(FIXTURES))
    mcore_load_check.run(str(out / ITER), str(resave), name, tp, pp)
    expected = global_tensors(MCORE / name / ITER)
    saved = global_tensors(resave)
    assert set(saved) == set(expected)
    assert any(k.startswith("optimizer.") for k in saved)
    for key, tensor in saved.items():
        assert torch.equal(tensor, expected[key]), key
    assert chunks_by_rank(out / ITER) == chunks_by_rank(resave)
