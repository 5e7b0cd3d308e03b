"""reshard of tensor-parallel DeepSpeed checkpoints (Megatron-style mpu and AutoTP, ZeRO 1/2/3) to a new
tp and dp: `reshard --to tp=T,dp=W` (formats/deepspeed/resharding.py, split_tp.py).

Outputs read back equal at new sizes, and a rewrite at the same sizes being DeepSpeed's own files,
are checked in test_layout_matrix.py with the other layouts; here: a rewrite of a rewrite, a world
size keeping tp and the refusals. DeepSpeed loading outputs with the mpu model built at the new tp
(every master, moment and module weight equal to the truth of fixtures/generate_ds_tp.py cut for
each rank, then a training step): test_ds_engine_matrix.py.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ckptkit.ops.reshard import reshard
from conftest import DATA

TP_DATA = DATA / "ds_tp"
FIXTURES = sorted(p.name for p in TP_DATA.iterdir() if p.is_dir()) if TP_DATA.is_dir() else []
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no tensor-parallel fixtures (run fixtures/generate_ds_tp.py)")


def _cli(*args):
    from ckptkit_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def test_a_rewrite_of_a_rewrite_is_the_source_again(tmp_path):
    """tp 2 -> 4 -> 2 (dp 2 -> 1 -> 2): the files equal the first rewrite at tp 2 byte for byte."""
    if "mpu_z2_fp32" not in FIXTURES:
        pytest.skip("fixture mpu_z2_fp32 not generated")
    reshard(str(TP_DATA / "mpu_z2_fp32"), str(tmp_path / "a"), "tp=2,dp=2")
    reshard(str(TP_DATA / "mpu_z2_fp32"), str(tmp_path / "b"), "tp=4,dp=1")
    reshard(str(tmp_path / "b"), str(tmp_path / "c"), "tp=2,dp=2")
    for f in sorted((tmp_path / "a" / "global_step2").iterdir()):
        assert (tmp_path / "c" / "global_step2" / f.name).read_bytes() == f.read_bytes(), f.name


def test_world_size_keeps_tp_and_equals_the_explicit_sizes(tmp_path):
    if "mpu_z2_fp32" not in FIXTURES:
        pytest.skip("fixture mpu_z2_fp32 not generated")
    assert _cli("reshard", TP_DATA / "mpu_z2_fp32", tmp_path / "n", "--to", "8").exit_code == 0
    assert _cli("reshard", TP_DATA / "mpu_z2_fp32", tmp_path / "s", "--to", "tp=2,dp=4").exit_code == 0
    names = sorted(p.name for p in (tmp_path / "s" / "global_step2").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "n" / "global_step2").iterdir())
    for n in names:
        assert (tmp_path / "n" / "global_step2" / n).read_bytes() == (tmp_path / "s" / "global_step2" / n).read_bytes()


def _one_sentence_exit_2(res, *needles):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    line = res.output.strip().splitlines()[-1]
    for needle in needles:
        assert needle in line, line


@pytest.mark.parametrize(
    "name,to,needles",
    [
        ("mpu_z2_fp32", "tp=3,dp=1", ("--to tp=3", "word_embeddings.weight", "size 16", "cannot share equally")),
        ("mpu_z2_fp32", "tp=16,dp=1", ("query_key_value", "fused parts [8, 8, 8]")),
        ("mpu_z2_fp32", "3", ("tensor-parallel size 2 does not divide 3 ranks", "--to tp=1,dp=3")),
        ("mpu_z2_fp32", "tp=2,pp=2,dp=1", ("pipeline parallelism", "pp=1")),
        ("mpu_z2_fp32", "ep=2,dp=2", ("mixture-of-experts", "ep must be 1")),
    ],
)
def test_sizes_that_cannot_be_written_are_refused(tmp_path, name, to, needles):
    if not (TP_DATA / name).is_dir():
        pytest.skip(f"fixture {name} not generated")
    _one_sentence_exit_2(_cli("reshard", TP_DATA / name, tmp_path / "out", "--to", to), *needles)
    assert not (tmp_path / "out" / "latest").exists()
