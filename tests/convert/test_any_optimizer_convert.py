"""Any torch optimizer through convert, DCP reshard and consolidate, and no state lost silently.

Fixtures fsdp2_{sgd,adagrad,rmsprop}_w2 are FSDP2 runs of fixtures/generate.py (SGD with
momentum: momentum_buffer and no step; Adagrad: sum + step; RMSprop centered with momentum:
square_avg, momentum_buffer, grad_avg + step); their truth is torch's own
get_state_dict(full_state_dict=True). Outputs are read back with torch's own loaders
(torch.load, DCP's dcp_to_torch_save) and compared bit for bit; the slow tests load them into
FSDP2 at another world size and train a step (tests/dist/fsdp2_load_check.py).
"""

from __future__ import annotations

from pathlib import Path

import click

import json
import subprocess

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ckptkit_cli.main import cli
from conftest import DATA, ROOT, read_all, subprocess_env, torchrun_cmd

KINDS = ("sgd", "adagrad", "rmsprop")
STATE_KEYS = {
    "sgd": {"momentum_buffer"},
    "adagrad": {"sum", "step"},
    "rmsprop": {"square_avg", "momentum_buffer", "grad_avg", "step"},
}
CLIENT_CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
}  # no "optimizer" section: the client's torch.optim.SGD
pytestmark = pytest.mark.skipif(
    not all((DATA / f"fsdp2_{k}_w2").exists() for k in KINDS),
    reason="fixtures missing: run python fixtures/generate.py --only optimizers",
)


def _fixture(kind: str):
    return DATA / f"fsdp2_{kind}_w2"


def _truth(kind: str) -> dict:
    return torch.load(DATA / f"fsdp2_{kind}_w2.truth.pt", weights_only=True)


def _cli(*args) -> "click.testing.Result":
    return CliRunner().invoke(cli, [str(a) for a in args])


def _same(got: dict, truth: dict) -> list[str]:
    """Every key of both, tensors by dtype, shape and bytes, values by type and ==."""
    bad = sorted(f"missing {k}" for k in set(truth) - set(got)) + sorted(
        f"unexpected {k}" for k in set(got) - set(truth)
    )
    for k in set(got) & set(truth):
        a, b = got[k], truth[k]
        if isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
                bad.append(f"differs {k}")
        elif type(a) is not type(b) or a != b:
            bad.append(f"differs {k}: {a!r} != {b!r}")
    return bad


def _dcp_as_torch(path, tmp_path) -> dict:
    """torch's own full load of a DCP folder (format_utils.dcp_to_torch_save), flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.name}.full.pt"
    dcp_to_torch_save(str(path), str(out))
    return dict(flatten_state_dict(torch.load(out, weights_only=False))[0])


@pytest.mark.parametrize("kind", KINDS)
def test_convert_to_torch_keeps_every_state_key(tmp_path, kind):
    out = tmp_path / f"{kind}.pt"
    res = _cli("convert", _fixture(kind), out, "--to", "torch")
    assert res.exit_code == 0, res.output
    for key in STATE_KEYS[kind] - {"step"}:
        assert key in res.output  # the summary names the state keys it wrote
    got = dict(flatten_state_dict(torch.load(out, weights_only=True))[0])
    assert _same(got, _truth(kind)) == []


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_reshard_carries_every_state_key_and_the_extras(tmp_path, kind):
    out = tmp_path / f"{kind}_w3"
    res = _cli("reshard", _fixture(kind), out, "--to", "3")
    assert res.exit_code == 0, res.output
    opened, _, _ = read_all(out)
    assert opened.index.world_size == 3
    assert _same(_dcp_as_torch(out, tmp_path), _truth(kind)) == []


def test_dcp_sgd_to_zero2_with_a_client_optimizer_and_back(tmp_path):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(CLIENT_CONFIG))
    zero = tmp_path / "z2"
    res = _cli("convert", _fixture("sgd"), zero, "--to", "zero2", "--world-size", "3", "--ds-config", cfg)
    assert res.exit_code == 0, res.output
    truth = _truth("sgd")
    opened, tensors, objects = read_all(zero)
    assert opened.index.world_size == 3 and opened.index.metadata["deepspeed"]["stage"] == 2
    buffers = {k: v for k, v in tensors.items() if k.endswith(".momentum_buffer")}
    assert len(buffers) == 9
    for k, v in buffers.items():
        assert torch.equal(v, truth[k]), k
    # torch's SGD groups as they are: no DeepSpeed Adam keys added, none of torch's lost
    for g in (0, 1):
        for hyper in ("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize"):
            assert objects[f"optim.param_groups.{g}.{hyper}"] == truth[f"optim.param_groups.{g}.{hyper}"]
        assert f"optim.param_groups.{g}.bias_correction" not in objects
    assert not any(k.endswith(".step") and k.startswith("optim.state.") for k in objects)  # SGD keeps no step
    back = tmp_path / "back"
    res = _cli("convert", zero, back, "--to", "dcp", "--world-size", "2")
    assert res.exit_code == 0, res.output
    got = _dcp_as_torch(back, tmp_path)
    assert (
        _same(
            {k: v for k, v in got.items() if k.startswith(("model.", "optim."))},
            {k: v for k, v in truth.items() if k.startswith(("model.", "optim."))},
        )
        == []
    )


def test_a_deepspeed_optimizer_that_cannot_hold_the_state_is_refused(tmp_path):
    cfg = tmp_path / "adamw.json"
    cfg.write_text(json.dumps(dict(CLIENT_CONFIG, optimizer={"type": "AdamW", "params": {"lr": 0.01}})))
    res = _cli("convert", _fixture("sgd"), tmp_path / "z", "--to", "zero2", "--ds-config", cfg)
    assert res.exit_code == 2 and not (tmp_path / "z").exists()
    assert "'AdamW'" in res.output and "SGD" in res.output and "momentum_buffer" in res.output
    cfg.write_text(json.dumps(dict(CLIENT_CONFIG, optimizer={"type": "SGD", "params": {"lr": 0.01}})))
    res = _cli("convert", _fixture("rmsprop"), tmp_path / "z", "--to", "zero2", "--ds-config", cfg)
    assert res.exit_code == 2 and "'SGD'" in res.output and "RMSprop" in res.output


def test_model_only_writes_the_model_and_lists_what_it_dropped(tmp_path):
    out = tmp_path / "m"
    res = _cli("convert", _fixture("adagrad"), out, "--to", "dcp", "--model-only")
    assert res.exit_code == 0, res.output
    assert "dropped on request" in res.output and "--model-only" in res.output
    got = _dcp_as_torch(out, tmp_path)
    truth = _truth("adagrad")
    assert _same(got, {k: v for k, v in truth.items() if k.startswith("model.")}) == []
    res = _cli("convert", _fixture("adagrad"), tmp_path / "z", "--to", "zero2", "--model-only")
    assert res.exit_code == 2 and "--model-only does not apply" in res.output


def test_drop_leaves_out_what_it_matches_and_nothing_else(tmp_path):
    out = tmp_path / "d.pt"
    res = _cli(
        "convert",
        _fixture("rmsprop"),
        out,
        "--to",
        "torch",
        "--drop",
        "optim.state.*.grad_avg",
        "--drop",
        "extra.lr_history",
    )
    assert res.exit_code == 0, res.output
    assert "9 by --drop optim.state.*.grad_avg" in res.output and "1 by --drop extra.lr_history" in res.output
    got = dict(flatten_state_dict(torch.load(out, weights_only=True))[0])
    truth = {k: v for k, v in _truth("rmsprop").items() if not k.endswith(".grad_avg") and k != "extra.lr_history"}
    assert _same(got, truth) == []
    res = _cli("convert", _fixture("rmsprop"), tmp_path / "x.pt", "--to", "torch", "--drop", "optim.state.*.nothing")
    assert res.exit_code == 2 and "matches nothing" in res.output


def _sgd_as_torch_save(tmp_path, **top) -> "Path":
    """fsdp2_sgd_w2's truth, unflattened as a torch.save of {"model", "optim"} holds it, plus `top`."""
    nested = {"model": {}, "optim": {"state": {}, "param_groups": []}}
    for k, v in _truth("sgd").items():
        head, rest = k.split(".", 1)
        if head == "model":
            nested["model"][rest] = v
        elif rest.startswith("state."):
            name, key = rest[len("state.") :].rsplit(".", 1)
            nested["optim"]["state"].setdefault(name, {})[key] = v
        elif rest.startswith("param_groups."):
            g, hyper = rest[len("param_groups.") :].split(".", 1)
            while len(nested["optim"]["param_groups"]) <= int(g):
                nested["optim"]["param_groups"].append({})
            nested["optim"]["param_groups"][int(g)][hyper] = v
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(nested.get(k), dict):
            nested[k].update(v)
        else:
            nested[k] = v
    src = tmp_path / "ckpt.pt"
    torch.save(nested, src)
    return src


def test_a_value_convert_cannot_carry_stops_it_unless_dropped(tmp_path):
    src = _sgd_as_torch_save(tmp_path, optim={"swa_n": 5})  # in the optimizer: neither state nor group
    res = _cli("convert", src, tmp_path / "out", "--to", "dcp")
    assert res.exit_code == 2 and not (tmp_path / "out").exists()
    assert "optim.swa_n" in res.output and "--drop" in res.output and "Traceback" not in res.output
    res = _cli("convert", src, tmp_path / "out", "--to", "dcp", "--drop", "optim.swa_n")
    assert res.exit_code == 0, res.output
    assert "dropped on request" in res.output and "optim.swa_n" in res.output


def test_two_optimizers_are_refused_not_merged(tmp_path):
    src = _sgd_as_torch_save(tmp_path, optimizer={"state": {}, "param_groups": [{"lr": 0.1, "params": ["pos"]}]})
    res = _cli("convert", src, tmp_path / "out", "--to", "torch")
    assert res.exit_code == 2 and "2 optimizers (optim, optimizer)" in res.output


def test_consolidate_include_optimizer_writes_every_state_key(tmp_path):
    out = tmp_path / "hf"
    res = _cli("consolidate", _fixture("rmsprop"), out, "--include-optimizer")
    assert res.exit_code == 0, res.output
    optim = {}
    for f in sorted(out.glob("optimizer*.safetensors")):
        optim.update(load_file(str(f)))
    truth = _truth("rmsprop")
    want = {k[len("optim.") :]: v for k, v in truth.items() if k.startswith("optim.state.")}
    assert set(optim) == set(want)
    for k, v in want.items():
        assert optim[k].dtype == v.dtype and torch.equal(optim[k], v.reshape(optim[k].shape)), k


# ---- closed by torch: FSDP2 loads the outputs at another world size and trains a step ------------


def _fsdp2_load(tmp_path, ckpt, kind: str, world: int) -> dict:
    result = tmp_path / f"result_{kind}_{world}.json"
    cmd = torchrun_cmd(world) + [
        str(ROOT / "tests" / "dist" / "fsdp2_load_check.py"),
        "--optim",
        kind,
        "--ckpt",
        str(ckpt),
        "--truth",
        str(DATA / f"fsdp2_{kind}_w2.truth.pt"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rmsprop"])  # the most keys; SGD comes back through ZeRO below, and every
def test_fsdp2_loads_the_reshard_at_3(tmp_path, kind):  # reshard is read back by torch above, bit for bit
    out = tmp_path / "w3"
    assert _cli("reshard", _fixture(kind), out, "--to", "3").exit_code == 0
    doc = _fsdp2_load(tmp_path, out, kind, 3)
    assert doc["ok"], doc
    assert doc["world_size"] == 3 and doc["compared"] >= 40 and doc["trained_step"]


@pytest.mark.slow
def test_fsdp2_loads_sgd_back_from_zero2_at_3(tmp_path):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(CLIENT_CONFIG))
    assert (
        _cli(
            "convert", _fixture("sgd"), tmp_path / "z2", "--to", "zero2", "--world-size", "2", "--ds-config", cfg
        ).exit_code
        == 0
    )
    assert _cli("convert", tmp_path / "z2", tmp_path / "back", "--to", "dcp", "--world-size", "3").exit_code == 0
    doc = _fsdp2_load(tmp_path, tmp_path / "back", "sgd", 3)
    assert doc["ok"], doc
    assert doc["world_size"] == 3 and doc["compared"] >= 30 and doc["trained_step"]


@pytest.mark.parametrize(
    "optimizer,step_type",
    [
        ({"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}, torch.Tensor),  # torch.optim.AdamW
        (None, torch.Tensor),  # the client's AdamW
        ({"type": "AdamW", "params": {"lr": 0.01}}, int),  # DeepSpeed's FusedAdam
    ],
)
def test_adamw_step_follows_the_target_optimizer(tmp_path, optimizer, step_type):
    cfg = dict(CLIENT_CONFIG, **({"optimizer": optimizer} if optimizer else {}))
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    out = tmp_path / "z2"
    res = _cli(
        "convert", DATA / "fsdp2_w2", out, "--to", "zero2", "--world-size", "3", "--ds-config", tmp_path / "c.json"
    )
    assert res.exit_code == 0, res.output
    _, _, objects = read_all(out)
    truth = torch.load(DATA / "fsdp2_w2.truth.pt", weights_only=True)
    step = objects["optim.state.pos.step"]
    assert type(step) is step_type
    if step_type is torch.Tensor:  # torch's own 0-d float32 step, as it was
        assert step.dtype == torch.float32 and step.shape == () and torch.equal(step, truth["optim.state.pos.step"])
        assert "optim.param_groups.0.bias_correction" not in objects
        assert objects["optim.param_groups.0.amsgrad"] is False  # torch's group keys carried as they are
    else:
        assert step == int(truth["optim.state.pos.step"]) and objects["optim.param_groups.0.bias_correction"] is True


# ---- closed by DeepSpeed: its own optimizers' fixtures through DCP and back to ZeRO at 3 are loaded by
# DeepSpeed's engine in tests/formats/deepspeed/test_ds_engine_matrix.py (layout "zero_via_dcp") ------

DS_OPT = DATA / "deepspeed_optimizers"


# ---- Lightning: numbered optimizer state gets names (keys.py's rule), or is refused ------------

LIGHTNING = DATA / "lightning"


@pytest.mark.skipif(not (LIGHTNING / "single_w1.ckpt").exists(), reason="Lightning fixtures missing")
def test_lightning_ckpt_optimizer_is_converted_under_names(tmp_path):
    """single_w1.ckpt keeps AdamW's state by parameter number; Lightning's run recorded the order
    (fixture.json optimizer_order): each converted state equals the .ckpt's own at that number."""
    order = json.loads((LIGHTNING / "single_w1.ckpt.fixture.json").read_text())["optimizer_order"][0]
    out = tmp_path / "l.pt"
    res = _cli("convert", LIGHTNING / "single_w1.ckpt", out, "--to", "torch")
    assert res.exit_code == 0, res.output
    got = torch.load(out, weights_only=True)["optim"]
    ckpt = torch.load(LIGHTNING / "single_w1.ckpt", weights_only=False)["optimizer_states"][0]
    assert got["param_groups"][0]["params"] == order
    for i, name in enumerate(order):
        for key, value in ckpt["state"][i].items():
            assert torch.equal(got["state"][name][key], value), (name, key)


@pytest.mark.skipif(not (LIGHTNING / "groups_w1.ckpt").exists(), reason="Lightning fixtures missing")
def test_numbered_optimizer_without_proven_names_is_refused_or_dropped_on_request(tmp_path):
    res = _cli("convert", LIGHTNING / "groups_w1.ckpt", tmp_path / "o.pt", "--to", "torch")
    assert res.exit_code == 2 and "keyed by parameter number" in res.output and "--model-only" in res.output
    res = _cli("convert", LIGHTNING / "groups_w1.ckpt", tmp_path / "o.pt", "--to", "torch", "--model-only")
    assert res.exit_code == 0, res.output
    assert "no optimizer (dropped on request)" in res.output and "by --model-only" in res.output


def _torch_truth_from_ds_any(ds: dict, kind: str) -> dict:
    """DeepSpeed's truth of a client-optimizer fixture (every state key through
    safe_get_full_optimizer_state) in torch's recipe keys; the group hyperparameters are those
    torch's own constructor gives deepspeed_models.client_optimizer, with DeepSpeed's lr."""
    from helpers.convert_truth import dm, model_roles

    groups, frozen, buffers, ties = model_roles()
    ref = dm.client_optimizer(
        kind, [{"params": [torch.zeros(1, requires_grad=True)], "weight_decay": wd} for wd in (dm.WEIGHT_DECAY, 0.0)]
    )
    out: dict = {}
    for g, names in enumerate(groups):
        for n in names:
            out[f"model.{n}"] = ds[f"fp32.{n}"]
            for key in ds["state_keys"]:
                out[f"optim.state.{n}.{key}"] = ds[f"state.{key}.{n}"]
        hyper = {k: v for k, v in ref.param_groups[g].items() if k != "params"}
        for k, v in dict(hyper, lr=ds[f"lr.{g}"], params=names).items():
            out[f"optim.param_groups.{g}.{k}"] = v
    for n in frozen:
        out[f"model.{n}"] = ds[f"frozen.{n}"].float()
    for b in buffers:
        v = ds[f"buffer.{b}"]
        out[f"model.{b}"] = v.float() if v.is_floating_point() else v
    for alias, owner in ties.items():
        out[f"model.{alias}"] = out[f"model.{owner}"]
    return out


@pytest.mark.slow
@pytest.mark.skipif(not (DS_OPT / "z3_rmsprop_bf16_w2").exists(), reason="DeepSpeed optimizer fixtures missing")
def test_fsdp2_loads_deepspeed_rmsprop_converted_to_dcp_at_3(tmp_path):
    """ZeRO-3 bf16 with a client RMSprop (square_avg, momentum_buffer, grad_avg, step) at 2 ranks ->
    DCP at 3 -> an FSDP2 job at 3 with torch's RMSprop: every state equal to DeepSpeed's truth."""
    out = tmp_path / "dcp"
    res = _cli("convert", DS_OPT / "z3_rmsprop_bf16_w2", out, "--to", "dcp", "--world-size", "3")
    assert res.exit_code == 0, res.output
    truth = _torch_truth_from_ds_any(torch.load(DS_OPT / "z3_rmsprop_bf16_w2.truth.pt", weights_only=True), "RMSprop")
    torch.save(truth, tmp_path / "truth.pt")
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(3) + [
        str(ROOT / "tests" / "dist" / "fsdp2_load_check.py"),
        "--model",
        "ds",
        "--optim",
        "rmsprop",
        "--ckpt",
        str(out),
        "--truth",
        str(tmp_path / "truth.pt"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result.read_text())
    assert doc["ok"], doc
    assert doc["world_size"] == 3 and doc["compared"] >= 60 and doc["trained_step"]
