"""reshard of DeepSpeed mixture-of-experts checkpoints (deepspeed.moe.layer.MoE, ZeRO 1/2) to a new
expert-parallel size and data-parallel world size: `reshard --to ep=E,dp=W` (moe_writer.py).

Structural checks need no engine: ckptkit reads each output back equal, bit for bit, to the source
(every fp32 master, Adam moment, step and module weight, under its global expert id), at the new
sizes, and a rewrite at the same sizes is DeepSpeed's own files object for object. Two DeepSpeed
launches (tests/dist/ds_moe_load_check.py) load outputs with the model built at the new ep_size and
world size, compare everything with the truth of fixtures/generate_ds_moe.py, and train a step.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner

from ckptkit.ops.reshard import reshard
from conftest import DATA, ROOT, assert_tensor_equal, read_all, subprocess_env, torchrun_cmd
from helpers.ds_fixtures import DS_DATA, needs_deepspeed

MOE_DATA = DATA / "ds_moe"
FIXTURES = sorted(p.name for p in MOE_DATA.glob("moe*") if p.is_dir()) if MOE_DATA.is_dir() else []
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no MoE fixtures (run fixtures/generate_ds_moe.py)")
MARK = ".deepspeed_moe.experts.deepspeed_experts."

# (fixture, --to, expected (ep, dp)): grow and shrink ep and dp, odd worlds (end padding), a layer
# with one expert per rank (moe2 at ep 2), a plain world size keeping the source's ep
COMBOS = [
    ("moe_z1_fp32_w2_k1", "ep=1,dp=1", (1, 1)),
    ("moe_z1_fp32_w2_k1", "ep=1,dp=3", (1, 3)),
    ("moe_z1_fp32_w2_k1", "ep=4,dp=8", (4, 8)),
    ("moe_z2_bf16_w2_k2", "ep=2,dp=6", (2, 6)),
    ("moe_z2_fp32_w4_k1", "ep=4,dp=4", (4, 4)),
    ("moe_z2_fp32_w4_k1", "ep=1,dp=5", (1, 5)),
    ("moe_z1_bf16_w4_k2", "ep=4,dp=12", (4, 12)),
    ("moe_z1_bf16_w4_k2", "ep=2,dp=2", (2, 2)),
    ("moe2_z2_fp32_w2_k1", "ep=1,dp=3", (1, 3)),
    ("moe2_z2_fp32_w2_k1", "4", (2, 4)),
]


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


@pytest.mark.parametrize("name,to,sizes", [c for c in COMBOS if c[0] in FIXTURES])
def test_output_reads_back_equal_to_the_source(tmp_path, name, to, sizes):
    ep, dp = sizes
    reshard(str(MOE_DATA / name), str(tmp_path / "out"), to)
    src, s_tensors, s_objects = read_all(MOE_DATA / name)
    out, o_tensors, o_objects = read_all(tmp_path / "out")
    assert out.index.world_size == dp
    assert out.index.metadata["parallel"] == {"ep": ep, "dp": dp}
    assert out.index.metadata["deepspeed_moe"] == {
        "ep_size": ep,
        "expert_dp_size": dp // ep,
        "num_experts": _expert_counts(name),
    }
    assert set(o_tensors) == set(s_tensors)
    for key, value in s_tensors.items():
        assert_tensor_equal(o_tensors[key], value, key)
    counts = _expert_counts(name)
    experts = 0
    for key, entry in out.index.tensors.items():
        prefix, marked, tail = key.partition(MARK)
        if marked:
            layer = prefix.rsplit(".", 1)[-1]  # model.moe2, ds_module.moe, optim.state.moe
            expert = int(tail.split(".")[0])
            assert entry.attrs["parallel"] == {"ep": {"rank": expert // (counts[layer] // ep), "size": ep}}, key
            experts += 1
        else:
            assert "parallel" not in entry.attrs, key
    assert experts > 0
    steps = [k for k in s_objects if k.startswith("optim.state.") and k.endswith(".step")]
    assert steps and all(o_objects[k] == s_objects[k] for k in steps)
    for key in ("ds.global_steps", "ds.num_experts", "client.epoch", "ds.lr_scheduler"):
        if key in s_objects:
            assert o_objects[key] == s_objects[key], key
    assert o_objects["ds.dp_world_size"] == dp
    groups = [g for g in range(16) if f"optim.param_groups.{g}.name" in o_objects]
    names = {o_objects[f"optim.param_groups.{g}.name"] for g in groups if o_objects.get(f"optim.param_groups.{g}.moe")}
    assert len(groups) == 4 and names == {f"ep_size_{ep}"}
    tag = tmp_path / "out" / "global_step2"
    for f in (MOE_DATA / name / "global_step2").glob("layer_*_expert_*"):  # copied byte for byte
        assert (tag / f.name).read_bytes() == f.read_bytes(), f.name
    prefix = "bf16_" if _info(name)["dtype"] == "bf16" else ""
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == sorted(
        f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp)
    )


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
