"""reshard of DeepSpeed pipeline checkpoints to a new pp and dp: `reshard --to pp=P,dp=W`
(formats/deepspeed/pipeline_writer.py; layers to stages by --partition-method, pipeline_partition.py).

Structural checks need no engine: ckptkit's own pipeline reader reads each output back equal, bit for
bit, to the source (every fp32 master, Adam moment, step, module weight and buffer), with the file
set DeepSpeed writes at the new sizes; a rewrite at the same sizes is DeepSpeed's own files object for
object. The partition functions equal DeepSpeed's. Two DeepSpeed launches
(tests/dist/ds_pp_reshard_check.py) load outputs with the PipelineModule at the new sizes, compare
every master, moment, step and module weight with the truth of fixtures/generate_ds_pp.py, and
train a step.
"""
from __future__ import annotations

import json
import random
import subprocess

import pytest
import torch

from ckptkit.ops.reshard import reshard
from ckptkit.formats.deepspeed import pipeline_partition
from conftest import DATA, ROOT, assert_tensor_equal, read_all, subprocess_env, torchrun_cmd
from ds_helpers import needs_deepspeed
from helpers_corrupt import run_cli

PP_DATA = DATA / "ds_pp"
pytestmark = pytest.mark.skipif(not (PP_DATA / "pp2_dp2_z1_fp32").is_dir(),
                                reason="no pipeline fixtures (run fixtures/generate_ds_pp.py)")

# (fixture, --to, --partition-method, (pp, dp), stage boundaries DeepSpeed gives its 6 layers)
COMBOS = [
    ("pp2_dp2_z1_fp32", "pp=1,dp=1", "uniform", (1, 1), [0, 6]),
    ("pp2_dp2_z1_fp32", "pp=1,dp=3", "uniform", (1, 3), [0, 6]),
    ("pp2_dp2_z1_fp32", "pp=2,dp=1", "parameters", (2, 1), [0, 3, 6]),
    ("pp2_dp2_z1_fp32", "pp=3,dp=2", "uniform", (3, 2), [0, 2, 4, 6]),
    ("pp2_dp2_z1_fp32", "pp=4,dp=1", "parameters", (4, 1), [0, 1, 3, 5, 6]),
    ("pp2_dp2_z1_fp32", "pp=4,dp=3", "uniform", (4, 3), [0, 2, 4, 5, 6]),
    ("pp2_dp2_z1_fp32", "pp=6,dp=1", "uniform", (6, 1), [0, 1, 2, 3, 4, 5, 6]),
    ("pp2_dp2_z1_fp32", "6", "uniform", (2, 3), [0, 3, 6]),
    ("pp2_dp2_z1_bf16", "pp=1,dp=2", "uniform", (1, 2), [0, 6]),
    ("pp2_dp2_z1_bf16", "pp=3,dp=3", "parameters", (3, 3), [0, 2, 4, 6]),
    ("pp2_dp2_z1_fp16", "pp=4,dp=2", "uniform", (4, 2), [0, 2, 4, 5, 6]),
    ("pp2_dp1_z1_fp32_tiedhead", "pp=3,dp=1", "uniform", (3, 1), [0, 2, 4, 6]),
    ("pp2_dp2_z1_fp32_mptopo", "pp=1,dp=2", "uniform", (1, 2), [0, 6]),
    ("pp2_dp2_z0_bf16", "pp=1,dp=3", "uniform", (1, 3), [0, 6]),
    ("pp2_dp2_z0_bf16", "pp=3,dp=1", "parameters", (3, 1), [0, 2, 4, 6]),
]


def _files(name: str, pp: int, dp: int) -> list[str]:
    src = PP_DATA / name / "global_step2"
    layers = sorted(p.name for p in src.glob("layer_*"))
    prefix = "bf16_" if any(src.glob("bf16_*")) else ""
    return sorted(layers + [f"mp_rank_{s:02d}_model_states.pt" for s in range(pp)]
                  + [f"{prefix}zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for s in range(pp) for d in range(dp)])


@pytest.mark.parametrize("name,to,method,sizes,parts", COMBOS)
def test_output_reads_back_equal_to_the_source(tmp_path, name, to, method, sizes, parts):
    pp, dp = sizes
    res = run_cli("reshard", PP_DATA / name, tmp_path / "out", "--to", to, "--partition-method", method)
    assert res.code == 0, res.output
    _, want, _ = read_all(PP_DATA / name)
    opened, got, objects = read_all(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for key in want:
        assert_tensor_equal(got[key], want[key], key)
    index = opened.index
    assert index.world_size == pp * dp and index.metadata["parallel"] == {"pp": pp, "dp": dp}
    layers = index.metadata["deepspeed"]["pipeline"]["layers"]  # layer -> stage, as read back
    assert all(parts[s] <= int(layer) < parts[s + 1] for layer, s in layers.items()), (layers, parts)
    assert objects["ds.mp_world_size"] == pp and objects["ds.dp_world_size"] == dp
    assert objects["ds.checkpoint_parallel_dimensions"]["pp_degree"] == pp
    assert sorted(p.name for p in (tmp_path / "out" / "global_step2").iterdir()) == _files(name, pp, dp)
    for f in (PP_DATA / name / "global_step2").glob("layer_*"):  # a layer's own state: copied byte for byte
        assert (tmp_path / "out" / "global_step2" / f.name).read_bytes() == f.read_bytes()


def _same(a, b, where: str) -> None:
    """Two unpickled DeepSpeed structures equal object for object (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert_tensor_equal(b, a, where)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif type(a).__name__ == "fragment_address":
        assert type(b).__name__ == "fragment_address" and (a.numel, a.start) == (b.numel, b.start), where
    else:
        assert type(a) is type(b) and repr(a) == repr(b), where


@needs_deepspeed
@pytest.mark.parametrize("name", ["pp2_dp2_z1_fp32", "pp2_dp2_z1_bf16", "pp2_dp2_z0_bf16", "pp2_dp1_z1_fp32_tiedhead",
                                  "pp2_dp2_z1_fp32_mptopo"])
def test_same_sizes_rewrite_is_deepspeeds_own_files(tmp_path, name):
    """pp and dp unchanged: every file equals what DeepSpeed saved (param_shapes and buffer_names of
    each stage, flat partitions, slice mappings, world sizes)."""
    info = json.loads((PP_DATA / name / "fixture.json").read_text())
    res = run_cli("reshard", PP_DATA / name, tmp_path / "out", "--to", f"pp={info['pp']},dp={info['dp']}",
                  "--partition-method", "uniform")
    assert res.code == 0, res.output
    src = PP_DATA / name / "global_step2"
    assert sorted(p.name for p in (tmp_path / "out" / "global_step2").iterdir()) == sorted(p.name for p in src.iterdir())
    for f in sorted(src.iterdir()):
        # DeepSpeed's own pickles (fragment_address, ZeroStageEnum): our fixtures and our output
        _same(torch.load(f, weights_only=False), torch.load(tmp_path / "out" / "global_step2" / f.name,
                                                            weights_only=False), f.name)


def test_a_rewrite_of_a_rewrite_is_the_source_again(tmp_path):
    """pp 2 -> 3 -> 2 (dp 2 -> 1 -> 2): the files equal the first rewrite at pp 2 byte for byte."""
    src = str(PP_DATA / "pp2_dp2_z1_fp32")
    reshard(src, str(tmp_path / "a"), "pp=2,dp=2")
    reshard(src, str(tmp_path / "b"), "pp=3,dp=1")
    reshard(str(tmp_path / "b"), str(tmp_path / "c"), "pp=2,dp=2")
    for f in sorted((tmp_path / "a" / "global_step2").iterdir()):
        assert (tmp_path / "c" / "global_step2" / f.name).read_bytes() == f.read_bytes(), f.name


def test_world_size_keeps_pp_and_equals_the_explicit_sizes(tmp_path):
    assert run_cli("reshard", PP_DATA / "pp2_dp2_z1_fp32", tmp_path / "n", "--to", "8").code == 0
    assert run_cli("reshard", PP_DATA / "pp2_dp2_z1_fp32", tmp_path / "s", "--to", "pp=2,dp=4").code == 0
    names = sorted(p.name for p in (tmp_path / "s" / "global_step2").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "n" / "global_step2").iterdir())
    for n in names:
        assert (tmp_path / "n" / "global_step2" / n).read_bytes() == (tmp_path / "s" / "global_step2" / n).read_bytes()


@pytest.mark.parametrize("name,args,code,needles", [
    ("pp2_dp2_z1_fp32", ["--to", "tp=2,pp=2,dp=1"], 2, ["adding tensor parallelism", "give pp=...,dp=... with tp=1"]),
    ("pp2_dp2_z1_fp32", ["--to", "ep=2,pp=2"], 2, ["no mixture-of-experts layers, so ep must be 1"]),
    ("pp2_dp2_z1_fp32", ["--to", "3"], 2, ["pipeline size 2 does not divide 3 ranks", "--to pp=1,dp=3"]),
    ("pp2_dp2_z1_fp32", ["--to", "pp=7,dp=1"], 2, ["has 6 layers, fewer than the 7 pipeline stages"]),
    ("pp1_dp2_z1_fp32", ["--to", "pp=2,dp=1"], 2, ["single-stage pipeline checkpoint with tied modules (embed)"]),
    ("pp2_dp2_z1_fp32", ["--to", "pp=2,dp=1", "--partition-method", "type:Block"], 2, ["'type:Block' is not one of"]),
])
def test_sizes_that_cannot_be_written_are_refused(tmp_path, name, args, code, needles):
    res = run_cli("reshard", PP_DATA / name, tmp_path / "out", *args)
    assert res.code == code, res.output
    assert all(n in res.output for n in needles) and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_stages_the_checkpoint_does_not_determine_are_refused():
    """new_stages' checks can fire: a source whose layer stages the method cannot give, and one that
    says nothing of its stages (so unseen trailing state-less layers would move the boundaries)."""
    from ckptkit.errors import UnsupportedError
    from ckptkit.formats.deepspeed import pipeline_writer
    from ckptkit.formats.registry import open_checkpoint

    index = open_checkpoint(str(PP_DATA / "pp2_dp2_z1_fp32")).index
    layers, stage_of = pipeline_writer.layer_table(index)
    assert [x.kind for x in layers] == ["tied", "layer", "layer", "layer", "layer", "tied"]
    assert stage_of == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    _, parts = pipeline_writer.new_stages(index, layers, stage_of, "uniform", 4)
    assert parts == [0, 2, 4, 5, 6]
    with pytest.raises(UnsupportedError, match=r"do not split into its 2 stages with --partition-method uniform"):
        pipeline_writer.new_stages(index, layers, {0: 1}, "uniform", 4)
    with pytest.raises(UnsupportedError, match=r"depends on how many state-less layers follow layer 5"):
        pipeline_writer.new_stages(index, layers, {}, "uniform", 4)


@needs_deepspeed
def test_partition_functions_equal_deepspeeds():
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    rng = random.Random(7)
    for n in range(0, 11):
        for m in range(1, 8):
            assert pipeline_partition.partition_uniform(n, m) == list(partition_uniform(n, m)), (n, m)
            for _ in range(6):
                w = [rng.choice([0, 1, 16, 72, 88, 110, rng.randint(0, 500)]) for _ in range(n)]
                want = [int(x) for x in partition_balanced(w, m)]
                assert pipeline_partition.partition_balanced(w, m) == want, (w, m)


# world -> (fixture, --to, pp, --partition-method): 4 ranks: fp32 pp 2 x dp 2 -> pp 4 (parameters,
# layers [0, 1, 3, 5, 6], a stage holding only the tied embedding, another only the tied head);
# 2 ranks: bf16 (ZeRO-1) pp 2 x dp 2 -> one stage over 2 ranks (both tied layers on one stage)
ENGINE_PLAN = {
    4: ("pp2_dp2_z1_fp32", "pp=4,dp=1", 4, "parameters"),
    2: ("pp2_dp2_z1_bf16", "pp=1,dp=2", 1, "uniform"),
}


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("world", sorted(ENGINE_PLAN))
def test_deepspeed_loads_the_resharded_pipeline_and_trains(tmp_path, world):
    name, to, pp, method = ENGINE_PLAN[world]
    out = tmp_path / "out"
    pipeline_partition.use_partition_method(method)
    try:
        reshard(str(PP_DATA / name), str(out), to)
    finally:
        pipeline_partition.use_partition_method(None)
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(world) + [str(ROOT / "tests" / "dist" / "ds_pp_reshard_check.py"), "--ckpt", str(out),
                                 "--fixture", name, "--pp", str(pp), "--partition-method", method,
                                 "--result", str(result)]
    proc = subprocess.run(cmd, env={**subprocess_env(), "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                          timeout=600)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["ok"], [{k: p.get(k) for k in ("error", "mismatches")} for p in r["ranks"]]
    # per rank: each of its stage's trainable params gives fp32, exp_avg, exp_avg_sq, step, module
    # (5 each), frozen weights 2 (module, frozen), buffers 1, plus global counters none
    assert r["world_size"] == world and r["pp"] == pp and r["compared"] >= 5 * 13
