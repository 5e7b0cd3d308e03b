"""3-D DeepSpeed checkpoints (pipeline x tensor x data parallel) against real DeepSpeed runs.

The fixtures (fixtures/generate_ds_3d.py) were written by DeepSpeed on CPU with Megatron-DeepSpeed's
PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1 or 2): a PipelineModule whose layers are
column/row-parallel (fixtures/ds_tp_models.py), ZeRO 1, AdamW, 2 steps. The truth was taken on
every rank through DeepSpeed's API (safe_get_full_fp32_param, safe_get_full_optimizer_state, the
stage module's weights) and joined along the split dims the layers define. DeepSpeed loading a
3-D reshard: test_ds_engine_matrix.py.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.ops.consolidate import consolidate
from conftest import DATA, assert_tensor_equal, read_all
from helpers.corrupt import run_cli

D3 = DATA / "ds_3d"
FIXTURES = sorted(p.name for p in D3.iterdir() if p.is_dir()) if D3.exists() else []
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no 3-D fixtures (run fixtures/generate_ds_3d.py)")
INDEX_KEY = {
    "fp32": "model.{}",
    "exp_avg": "optim.state.{}.exp_avg",
    "exp_avg_sq": "optim.state.{}.exp_avg_sq",
    "module": "ds_module.{}",
}


def _truth(name: str) -> dict:
    return torch.load(D3 / f"{name}.truth.pt", weights_only=True)


def _info(name: str) -> dict:
    return json.loads((D3 / name / "fixture.json").read_text())


@pytest.mark.parametrize("name", FIXTURES)
def test_index_equals_deepspeed_truth(name):
    info, truth = _info(name), _truth(name)
    opened, tensors, objects = read_all(D3 / name)
    index = opened.index
    pp, tp, dp = info["pp"], info["tp"], info["dp"]
    assert index.format == "deepspeed" and index.world_size == pp * tp * dp
    assert index.metadata["parallel"] == {"pp": pp, "tp": tp, "dp": dp}
    compared = 0
    for key, expected in truth.items():
        kind, _, pname = key.partition(".")
        if kind in INDEX_KEY:
            assert_tensor_equal(tensors[INDEX_KEY[kind].format(pname)], expected, key)
            compared += 1
        elif kind == "step":
            assert objects[f"optim.state.{pname}.step"] == expected, key
        elif kind == "split":  # each entry of a parameter: its stage and its tp split as the layer made it
            stage = truth[f"stage.{pname}"]
            dim = None if expected[0] == "replicated" else expected[1]
            for pattern in INDEX_KEY.values():
                par = index.tensors[pattern.format(pname)].attrs["parallel"]
                assert par["pp"] == {"stage": stage, "size": pp}, (key, par)
                assert (par["tp"]["dim"], par["tp"]["size"]) == (dim, tp), (key, par)
                assert ("fused" in par["tp"]) == (expected[0] == "fused"), (key, par)
    n_params = sum(1 for k in truth if k.startswith("split."))
    assert n_params == 28 and compared == 4 * n_params
    assert {k[len("model.") :] for k in index.tensors if k.startswith("model.")} == {
        k.partition(".")[2] for k in truth if k.startswith("split.")
    }
    assert objects["ds.global_steps"] == truth["global_steps"] == index.step == 2
    # the exact files DeepSpeed wrote (recorded by the generator) are what the index read
    assert sorted(index.files) == sorted(f for f in truth["files"] if f.startswith("global_step2/"))
    assert index.metadata["deepspeed"]["pipeline"]["layers"] == {"0": 0, "1": 0, "2": 0, "3": 1, "4": 1}


@pytest.mark.parametrize("name", FIXTURES)
def test_consolidate_is_bit_exact(tmp_path, name):
    truth = _truth(name)
    consolidate(str(D3 / name), str(tmp_path / "out"), include_optimizer=True)
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    optim = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    masters = {k.partition(".")[2]: v for k, v in truth.items() if k.startswith("fp32.")}
    assert sorted(out) == sorted(masters)
    for pname, value in masters.items():
        assert_tensor_equal(out[pname], value, pname)
        for kind in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(optim[f"state.{pname}.{kind}"], truth[f"{kind}.{pname}"], f"{kind}.{pname}")


def test_inspect_verify_diff_and_plan_read_it(tmp_path):
    a = D3 / "pp2_tp2_dp2_z1_fp32"
    res = run_cli("inspect", a)
    assert res.code == 0 and "tp 2 x pp 2 x dp 2" in res.output, res.output
    assert re.search(
        r"model\.1\.attention\.query_key_value\.weight .* tp fused\(3\) dim 0/2, pp stage 0/2", res.output
    ), res.output
    res = run_cli("inspect", "--json", a)
    assert res.code == 0, res.output
    res = run_cli("verify", "--deep", a)
    assert res.code == 0 and "every byte read" in res.output, res.output
    assert run_cli("convert", a, tmp_path / "t.pt", "--to", "torch").code == 0
    res = run_cli("diff", a, tmp_path / "t.pt")
    assert res.code == 0 and "different" not in res.output, res.output
    res = run_cli("diff", a, D3 / "pp2_tp2_dp1_z1_fp32")  # dp 2 vs 1: other data, other values
    assert res.code == 1 and "different" in res.output, res.output
    res = run_cli("plan", a)
    assert res.code == 0 and "layer_02-model_01-model_states.pt" in res.output, res.output


def test_verify_deep_names_a_tp_replica_that_differs(tmp_path):
    """A replicated tensor (layer norm) is read from tp rank 0; tp rank 1's copy is compared."""
    d = tmp_path / "c"
    shutil.copytree(D3 / "pp2_tp2_dp1_z1_fp32", d)
    path = d / "global_step2" / "layer_03-model_01-model_states.pt"
    state = torch.load(path, weights_only=True)
    state["final_layernorm.weight"][2] += 1
    torch.save(state, path)
    res = run_cli("verify", "--deep", d)
    assert res.code == 1 and "ds_module.3.final_layernorm.weight: tensor-parallel rank 1's copy" in res.output, (
        res.output
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("--to", "3"),
            "--to 3: the source's tp x pp = 2 x 2 does not divide 3 ranks; give the new sizes, "
            "e.g. --to tp=1,pp=1,dp=3",
        ),  # an example of 3 ranks
        (("--to", "6"), "e.g. --to tp=2,pp=1,dp=3"),
        (("--to", "tp=3,pp=2,dp=1", "--partition-method", "uniform"), "--to tp=3: "),
        (("--to", "tp=2,pp=2,dp=1"), "do not split into its 2 stages with --partition-method parameters"),
    ],
)
def test_reshard_refusals_are_one_sentence(tmp_path, args, message):
    res = run_cli("reshard", D3 / "pp2_tp2_dp1_z1_fp32", tmp_path / "out", *args)
    assert res.code == 2 and message in res.output and "Traceback" not in res.output, res.output
    res = run_cli("convert", D3 / "pp2_tp2_dp1_z1_fp32", tmp_path / "z", "--to", "zero1", "--world-size", "2")
    assert res.code == 2 and "Traceback" not in res.output and "not supported yet" in res.output, res.output


def test_a_missing_tp_layer_file_is_named(tmp_path):
    d = tmp_path / "c"
    shutil.copytree(D3 / "pp2_tp2_dp1_z1_fp32", d)
    (d / "global_step2" / "layer_04-model_01-model_states.pt").unlink()
    res = run_cli("consolidate", d, tmp_path / "out")
    assert (
        res.code == 2
        and "layer_04-model_01-model_states.pt: file is missing (tensor-parallel rank 0 has layer 4's file"
        in res.output
        and "Traceback" not in res.output
    ), res.output


@pytest.mark.parametrize("world", ["2", "mesh=dp_shard:2,tp:2"])
def test_convert_to_dcp_reads_back_as_the_truth(tmp_path, world):
    """convert --to fsdp2 (1-D, and onto a (dp_shard, tp) mesh by the recorded tp splits): read back,
    every master and Adam state equals DeepSpeed's truth."""
    name = "pp2_tp2_dp2_z1_fp32"
    truth = _truth(name)
    res = run_cli("convert", D3 / name, tmp_path / "dcp", "--to", "fsdp2", "--world-size", world)
    assert res.code == 0, res.output
    back, tensors, _ = read_all(tmp_path / "dcp")
    assert back.index.format == "dcp"
    compared = 0
    for key, value in truth.items():
        kind, _, pname = key.partition(".")
        if kind in ("fp32", "exp_avg", "exp_avg_sq"):
            assert_tensor_equal(tensors[INDEX_KEY[kind].format(pname)], value, key)
            compared += 1
    assert compared == 3 * 28


def test_tp_rules_file_decides_before_the_built_in_rules(tmp_path):
    """--tp-rules FILE comes before the built-in Megatron rules: a rule splitting the head along
    dim 1 (wrong for this model) changes its joined shape, the built-in one gives DeepSpeed's."""
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"pattern": "*output_layer.weight", "split": 1}]}))
    src = D3 / "pp2_tp2_dp1_z1_fp32"
    res = run_cli("inspect", "--tp-rules", rules, src)
    assert res.code == 0 and re.search(
        r"model\.4\.output_layer\.weight +float32 +\[8, 16\] .* tp dim 1/2", res.output
    ), res.output
    res = run_cli("inspect", src)
    assert res.code == 0 and re.search(
        r"model\.4\.output_layer\.weight +float32 +\[16, 8\] .* tp dim 0/2", res.output
    ), res.output
    assert tuple(_truth("pp2_tp2_dp1_z1_fp32")["fp32.4.output_layer.weight"].shape) == (16, 8)


def test_reshard_with_a_type_partition_method(tmp_path):
    """--partition-method type:REGEX with --layer-types (EmbedTP, LayerTP x2, FinalNorm, HeadTP, as
    fixtures/generate_ds_3d.py builds them): "layertp|norm" gives the source's [0, 3, 5] at pp 2 and
    [0, 2, 3, 5] at pp 3 (DeepSpeed's partition_balanced over [0, 1, 1, 1, 0]); read back equal."""
    name = "pp2_tp2_dp1_z1_fp32"
    res = run_cli(
        "reshard",
        D3 / name,
        tmp_path / "out",
        "--to",
        "tp=2,pp=3,dp=1",
        "--partition-method",
        "type:layertp|norm",
        "--layer-types",
        "EmbedTP,LayerTP*2,FinalNorm,HeadTP",
    )
    assert res.code == 0, res.output
    back, tensors, _ = read_all(tmp_path / "out")
    assert back.index.metadata["deepspeed"]["pipeline"]["layers"] == {"0": 0, "1": 0, "2": 1, "3": 2, "4": 2}
    _, want, _ = read_all(D3 / name)
    assert sorted(tensors) == sorted(want)
    for key in want:
        assert_tensor_equal(tensors[key], want[key], key)
