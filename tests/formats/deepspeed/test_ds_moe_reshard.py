"""reshard of DeepSpeed mixture-of-experts checkpoints (deepspeed.moe.layer.MoE, ZeRO 1/2) to a new
expert-parallel size and data-parallel world size: `reshard --to ep=E,dp=W` (resharding.py, split_ep.py).

Outputs read back equal at new sizes (under each expert's global id), and a rewrite at the same
sizes being DeepSpeed's own files, are checked in test_layout_matrix.py with the other layouts;
here: the refusals and a dense source. DeepSpeed loading outputs with the model built at the new
ep_size and world size (everything equal to the truth of fixtures/generate_ds_moe.py, then a
training step): test_ds_engine_matrix.py.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from conftest import DATA
from helpers.ds_fixtures import DS_DATA

MOE_DATA = DATA / "ds_moe"
FIXTURES = sorted(p.name for p in MOE_DATA.glob("moe*") if p.is_dir()) if MOE_DATA.is_dir() else []
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no MoE fixtures (run fixtures/generate_ds_moe.py)")


def _cli(*args):
    from ckptkit_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _one_sentence_exit_2(res, *needles):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    line = res.output.strip().splitlines()[-1]
    for needle in needles:
        assert needle in line, line


@pytest.mark.parametrize(
    "name,to,needles",
    [
        ("moe_z1_fp32_w2_k1", "ep=3,dp=4", ("ep=3,dp=4", "must divide the data-parallel world size")),
        ("moe2_z2_fp32_w2_k1", "ep=4,dp=4", ("'moe2' has 2 experts", "ep must divide every layer's expert count")),
        ("moe_z1_fp32_w2_k1", "3", ("expert-parallel size 2 does not divide 3 ranks", "--to ep=1,dp=3")),
        (
            "moe_z1_fp32_w2_k1",
            "tp=2,dp=4",
            (
                "adding tensor parallelism to the mixture-of-experts checkpoint",
                "not supported yet (give ep=...,dp=... with tp=1,pp=1)",
            ),
        ),
    ],
)
def test_sizes_that_cannot_be_written_are_refused(tmp_path, name, to, needles):
    if name not in FIXTURES:
        pytest.skip(f"fixture {name} not generated")
    _one_sentence_exit_2(_cli("reshard", MOE_DATA / name, tmp_path / "o", "--to", to), *needles)
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not (DS_DATA / "z2_fp32_w2").is_dir(), reason="no dense DeepSpeed fixture z2_fp32_w2")
def test_dense_source_ep_refused_and_dp_alone_is_a_world_size(tmp_path):
    src = DS_DATA / "z2_fp32_w2"
    _one_sentence_exit_2(
        _cli("reshard", src, tmp_path / "o", "--to", "ep=2,dp=4"), "not supported yet", "mixture-of-experts"
    )
    assert _cli("reshard", src, tmp_path / "a", "--to", "dp=3").exit_code == 0
    assert _cli("reshard", src, tmp_path / "b", "--to", "3").exit_code == 0
    a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert a == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    for rel in a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
