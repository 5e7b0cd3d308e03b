"""Tensor-parallel DeepSpeed checkpoints whose slices differ in length (DeepSpeed's AutoTP on a model
whose sizes tp=2 does not divide: fixtures/data/ds_tp_uneven/, written by
`fixtures/generate_ds_tp.py --uneven`) are read into full tensors equal, bit for bit, to DeepSpeed's
own (safe_get_full_fp32_param / safe_get_full_optimizer_state per tp rank, joined in rank order);
every command works on them; reshard cuts a new tp as AutoTP does (autotp_split.py), the values
of its rule from config.json, the saved config or --kv-heads / --tp-grain-size, and refuses in one
sentence what it cannot decide. DeepSpeed loading the outputs: test_ds_engine_matrix.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import ROOT
from helpers.ds_fixtures import assert_same_pickled

torch = pytest.importorskip("torch")

DATA = ROOT / "fixtures" / "data" / "ds_tp_uneven"
VERSIONS = json.loads((DATA / "VERSIONS.json").read_text()) if (DATA / "VERSIONS.json").exists() else {}
FIXTURES = sorted(VERSIONS.get("fixtures", {}))
KEY_OF = {
    "fp32": "model.{}",
    "exp_avg": "optim.state.{}.exp_avg",
    "exp_avg_sq": "optim.state.{}.exp_avg_sq",
    "module": "ds_module.{}",
}
pytestmark = pytest.mark.skipif(
    not FIXTURES, reason="fixtures/data/ds_tp_uneven/ not generated (python fixtures/generate_ds_tp.py --uneven)"
)


def _truth(name: str) -> dict:
    return torch.load(DATA / f"{name}.truth.pt", weights_only=False)


def _info(name: str) -> dict:
    return json.loads((DATA / name / "fixture.json").read_text())


def _cli(*args):
    from ckptkit_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _read(path: Path):
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.runner.fetch import Fetcher

    opened = open_checkpoint(str(path))
    return opened.index, Fetcher(opened.source, index=opened.index)


def _fetch(index, fetcher, key):
    from ckptkit.index.types import Box

    entry = index.tensors[key]
    return fetcher.fetch(entry, Box.whole(entry.shape))


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.numel() else t


@pytest.mark.parametrize("name", FIXTURES)
def test_uneven_slices_join_into_deepspeeds_full_tensors(name):
    index, fetcher = _read(DATA / name)
    truth = _truth(name)
    sizes = _info(name)["partition_sizes"]
    assert any(s and len(set(s)) > 1 for s in sizes.values()), "the fixture has no uneven split"
    compared = 0
    for k, want in truth.items():
        kind, _, param = k.partition(".")
        if kind not in KEY_OF or not isinstance(want, torch.Tensor):
            continue
        got = _fetch(index, fetcher, KEY_OF[kind].format(param))
        assert got.dtype == want.dtype and got.shape == want.shape, k
        assert torch.equal(_bits(got), _bits(want)), k
        tp = index.tensors[KEY_OF[kind].format(param)].attrs["parallel"]["tp"]
        if sizes.get(param) and len(set(sizes[param])) > 1:
            assert tp["sizes"] == sizes[param], k
        compared += 1
    assert compared >= 4 * 12


@pytest.mark.parametrize("name", FIXTURES[:1])
def test_inspect_verify_and_consolidate_work(name, tmp_path):
    from safetensors.torch import load_file

    r = _cli("inspect", DATA / name)
    assert r.exit_code == 0, r.output
    assert "tp 2" in r.output
    r = _cli("verify", "--deep", DATA / name)
    assert r.exit_code == 0, r.output
    r = _cli("consolidate", DATA / name, tmp_path / "st")
    assert r.exit_code == 0, r.output
    got = {}
    for f in (tmp_path / "st").glob("*.safetensors"):
        got.update(load_file(f))
    truth = _truth(name)
    params = [k[len("fp32.") :] for k in truth if k.startswith("fp32.")]
    assert sorted(got) == sorted(params)
    for p in params:
        assert torch.equal(got[p], truth[f"fp32.{p}"]), p


def _autotp_slices(full, tp: int, sizes: list[int] | None, dim: int):
    return [full] * tp if sizes is None else list(full.split(sizes, dim=dim))


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("tp", [1, 3])
def test_reshard_cuts_as_autotp_and_reads_back_equal(name, tp, tmp_path):
    """Each new rank's slices have the sizes DeepSpeed's own get_shard_size_list gives for the
    model's layer names, kv heads and grain, and the output reads back to the source's tensors."""
    tp_shard = pytest.importorskip("deepspeed.module_inject.tp_shard")
    info = _info(name)
    config = info["llama_config"]
    grain = info["shard_size_calls"][0]["tp_grain_size"]
    meta = tp_shard.AutoTPMeta(num_kv_heads=config["num_key_value_heads"], tp_grain_size=grain)
    out = tmp_path / "out"
    r = _cli("reshard", DATA / name, out, "--to", f"tp={tp},dp=1")
    assert r.exit_code == 0, r.output
    index, fetcher = _read(out)
    truth = _truth(name)
    calls = {c["name"]: c for c in info["shard_size_calls"]}
    from ckptkit.formats.deepspeed.autotp_split import layer_name

    for param, sizes in info["partition_sizes"].items():
        want = truth[f"fp32.{param}"]
        got = _fetch(index, fetcher, f"model.{param}")
        assert torch.equal(got, want), param
        if sizes is None or tp == 1:
            continue
        dim = tuple(truth[f"split.{param}"])[1]
        new_sizes = tp_shard.get_shard_size_list(want.shape[dim], tp, meta, calls[layer_name(param)]["name"])
        model = torch.load(out / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
        assert list(model["module"][param].shape)[dim] == new_sizes[0], param
        last = torch.load(out / "global_step2" / f"mp_rank_{tp - 1:02d}_model_states.pt", weights_only=False)
        assert list(last["module"][param].shape)[dim] == new_sizes[-1], param
        assert torch.equal(last["module"][param], truth[f"module.{param}"].split(new_sizes, dim=dim)[-1]), param


@pytest.mark.parametrize("name", FIXTURES)
def test_a_rewrite_at_the_source_sizes_is_deepspeeds_own_files(name, tmp_path):
    out = tmp_path / "out"
    r = _cli("reshard", DATA / name, out, "--to", "tp=2,dp=2")
    assert r.exit_code == 0, r.output
    for f in sorted((DATA / name / "global_step2").glob("*.pt")):
        want = torch.load(f, weights_only=False)
        got = torch.load(out / "global_step2" / f.name, weights_only=False)
        assert_same_pickled(want, got, f.name)


def _without_config(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    (dst / "config.json").unlink()
    return dst


def test_no_head_count_is_refused_where_the_cut_needs_it(tmp_path):
    src = _without_config(FIXTURES[0], tmp_path)
    r = _cli("reshard", src, tmp_path / "out", "--to", "tp=4,dp=1")
    assert r.exit_code == 2, r.output
    assert "AutoTP cuts by key/value heads" in r.output and "--kv-heads" in r.output
    assert r.output.count("\n") == 1 and not (tmp_path / "out").exists()
    r = _cli("reshard", src, tmp_path / "out2", "--to", "tp=3,dp=1", "--kv-heads", "3")
    assert r.exit_code == 0, r.output


def test_a_tp_that_leaves_a_rank_an_empty_slice_is_refused(tmp_path):
    """At tp=4 AutoTP gives the 4th rank none of the 3 key/value heads; DeepSpeed 0.19.8 then holds
    its empty q/k/v/o slices as frozen parameters (load_checkpoint reads them from
    frozen_param_fragments), which the writer does not lay out: refused, not written."""
    r = _cli("reshard", DATA / FIXTURES[0], tmp_path / "out", "--to", "tp=4,dp=1")
    assert r.exit_code == 2, r.output
    assert "into [8, 8, 8, 0] along dim 0 (3 key/value heads over 4 ranks)" in r.output
    assert r.output.count("\n") == 1 and not (tmp_path / "out").exists()


def test_values_that_do_not_give_the_source_slices_are_refused(tmp_path):
    r = _cli("reshard", DATA / FIXTURES[0], tmp_path / "out", "--to", "tp=3,dp=1", "--kv-heads", "6")
    assert r.exit_code == 2, r.output
    assert "where AutoTP, with 6 key/value heads (from --kv-heads)" in r.output
    assert not (tmp_path / "out").exists()


def test_megatron_style_tp_refuses_a_size_tp_does_not_divide_with_the_reason(tmp_path):
    mpu = ROOT / "fixtures" / "data" / "ds_tp" / "mpu_z2_fp32"
    if not mpu.is_dir():
        pytest.skip("fixtures/data/ds_tp/mpu_z2_fp32 not generated")
    r = _cli("reshard", mpu, tmp_path / "out", "--to", "tp=3,dp=1")
    assert r.exit_code == 2, r.output
    assert "cannot share equally (Megatron-style tensor parallelism" in r.output
    assert "so tp must divide it" in r.output


def test_rules_file_sizes_cut_before_autotps_rule(tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps(
            {
                "rules": [
                    {"pattern": "*.mlp.up_proj.weight", "split": 0, "sizes": [12, 12, 13]},
                    {"pattern": "*.mlp.down_proj.weight", "split": 0, "sizes": [12, 12, 13]},
                ]
            }
        )
    )
    name = "autotp_odd_z1_fp32"
    if name not in FIXTURES:
        pytest.skip(f"fixture {name} not generated")
    out = tmp_path / "out"
    r = _cli("reshard", DATA / name, out, "--to", "tp=3,dp=1", "--tp-rules", rules)
    assert r.exit_code == 2, r.output  # down_proj is split along dim 1, not 0
    assert "'model.layers.0.mlp.down_proj.weight' into [12, 12, 13] along dim 0" in r.output
    rules.write_text(
        json.dumps({"rules": [{"pattern": "re:.*\\.mlp\\.(up|down)_proj\\.weight", "split": 1, "sizes": [12, 12, 13]}]})
    )
    r = _cli("reshard", DATA / name, out, "--to", "tp=3,dp=1", "--tp-rules", rules)
    assert r.exit_code == 2, r.output  # up_proj is split along dim 0
    rules.write_text(
        json.dumps(
            {
                "rules": [
                    {"pattern": "*.mlp.up_proj.weight", "split": 0, "sizes": [12, 12, 13]},
                    {"pattern": "*.mlp.down_proj.weight", "split": 1, "sizes": [12, 12, 13]},
                ]
            }
        )
    )
    r = _cli("reshard", DATA / name, out, "--to", "tp=3,dp=1", "--tp-rules", rules)
    assert r.exit_code == 0, r.output
    truth = _truth(name)
    for t, rows in enumerate((12, 12, 13)):
        module = torch.load(out / "global_step2" / f"mp_rank_{t:02d}_model_states.pt", weights_only=False)["module"]
        up, down = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"
        assert torch.equal(module[up], truth[f"module.{up}"].split([12, 12, 13], dim=0)[t])
        assert torch.equal(module[down], truth[f"module.{down}"].split([12, 12, 13], dim=1)[t]), rows
        gate = "model.layers.0.mlp.gate_proj.weight"  # no sizes rule: AutoTP's near-even cut
        assert module[gate].shape[0] == (13, 12, 12)[t]
