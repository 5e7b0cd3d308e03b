"""reshard of DeepSpeed mixture-of-experts checkpoints (deepspeed.moe.layer.MoE, ZeRO 1/2) to a new
expert-parallel size and data-parallel world size: `reshard --to ep=E,dp=W` (resharding.py, split_ep.py).

Outputs read back equal at new sizes (under each expert's global id), and a rewrite at the same
sizes being DeepSpeed's own files, are checked in test_layout_matrix.py with the other layouts;
here: the refusals, a dense source, and two DeepSpeed launches (tests/dist/ds_moe_load_check.py)
that load outputs with the model built at the new ep_size and world size, compare everything with
the truth of fixtures/generate_ds_moe.py, and train a step.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner

from ckptkit.ops.reshard import reshard
from conftest import DATA, ROOT, subprocess_env, torchrun_cmd
from helpers.ds_fixtures import DS_DATA, needs_deepspeed

MOE_DATA = DATA / "ds_moe"
FIXTURES = sorted(p.name for p in MOE_DATA.glob("moe*") if p.is_dir()) if MOE_DATA.is_dir() else []
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no MoE fixtures (run fixtures/generate_ds_moe.py)")


def _info(name):
    return json.loads((MOE_DATA / name / "fixture.json").read_text())


def _cli(*args):
    from ckptkit_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _expert_counts(name) -> dict[str, int]:
    info = _info(name)
    return {
        "moe": info["num_experts"],
        **({"moe2": info["second_moe_experts"]} if info.get("second_moe_experts") else {}),
    }


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


# target world size -> (fixture, --to, ep): every output of one launch is loaded by DeepSpeed at
# that world size with the model built at that ep
# (docs/formats/deepspeed.md lists the other combinations checked by hand with the same worker)
ENGINE_PLAN = {
    2: [("moe_z2_fp32_w4_k1", "ep=2,dp=2", 2), ("moe2_z2_fp32_w2_k1", "ep=1,dp=2", 1)],
    4: [("moe_z1_fp32_w2_k1", "ep=4,dp=4", 4), ("moe_z2_bf16_w2_k2", "ep=4,dp=4", 4)],
}


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("world", sorted(ENGINE_PLAN))
def test_deepspeed_loads_the_resharded_experts_and_trains(tmp_path, world):
    batch = []
    for name, to, ep in ENGINE_PLAN[world]:
        if name not in FIXTURES:
            pytest.skip(f"fixture {name} not generated")
        out = tmp_path / f"{name}_{to.replace('=', '').replace(',', '_')}"
        reshard(str(MOE_DATA / name), str(out), to)
        batch.append({"ckpt": str(out), "fixture": name, "ep": ep})
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(world) + [
        str(ROOT / "tests" / "dist" / "ds_moe_load_check.py"),
        "--batch",
        str(tmp_path / "batch.json"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(
        cmd, env={**subprocess_env(), "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=900
    )
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(result.read_text())["results"]
    assert [(r["fixture"], r["ep"]) for r in results] == [(n, ep) for n, _, ep in ENGINE_PLAN[world]]
    for r, (name, _, _) in zip(results, ENGINE_PLAN[world]):
        assert r["ok"], {k: r.get(k) for k in ("fixture", "ep", "error", "mismatches")}
        # 4 params per expert, each with master, 2 moments, step and module weight, plus the dense ones
        experts = sum(_expert_counts(name).values())
        assert r["world_size"] == world and r["trained_step"] and r["compared"] >= 5 * 4 * experts
