"""convert from a Megatron-Core torch_dist checkpoint: the DCP it writes loads with torch's own
dcp.load into the state dict `get_state_dict(model, optim)` flattens (model.<name> per layer,
optim.state.<name>.<key>, optim.param_groups.<g>.<hyper>), and every value equals what MCore's
own load gave a TP1 PP1 model and optimizer (the fixtures' truth files, written by
fixtures/make_mcore_fixtures.py: `<name>.truth.pt` for the model, `<name>.optim_truth.pt` for the
optimizer, loaded by `optimizer.load_state_dict` as Megatron-LM does). A dp_reshardable
distributed optimizer's flat buffers cannot be mapped to parameters: refused in one sentence,
while the model alone converts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from safetensors.torch import load_file

from helpers import hostile
from ckptkit_cli.main import cli
from conftest import DATA

MCORE = DATA / "mcore"
STACKED = "decoder.layers."


def _per_layer_name(key: str, layer: int | None) -> str:
    return key if layer is None else f"{STACKED}{layer}.{key[len(STACKED) :]}"


def _model_truth(name: str) -> dict[str, torch.Tensor]:
    model = torch.load(MCORE / f"{name}.truth.pt", weights_only=True)
    return {_per_layer_name(*model["where"][n]): t for n, t in model["tensors"].items()}


def _truth(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    return _model_truth(name), torch.load(MCORE / f"{name}.optim_truth.pt", weights_only=True)


def _convert(source, out, *extra) -> str:
    run = CliRunner().invoke(cli, ["convert", str(source), str(out), *extra])
    assert run.exit_code == 0, run.output
    return run.output


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    want = want.contiguous()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), what


@pytest.mark.parametrize("name", ["tp2_swiglu_gqa", "pp2_tied", "tp2dp2_distopt_full"])
def test_dcp_output_loads_with_torch_into_mcores_own_model_and_optimizer(name, tmp_path):
    model, optim = _truth(name)
    out = tmp_path / "dcp"
    _convert(MCORE / name, out, "--to", "dcp", "--world-size", "2")
    keys = set(dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    expected: dict[str, object] = {f"model.{n}": torch.empty_like(t) for n, t in model.items()}
    for pname, states in optim["state"].items():
        for key, value in states.items():
            if key != "param":  # (the distributed optimizer's main copy: the model's own values)
                expected[f"optim.state.{pname}.{key}"] = torch.empty_like(value)
    for g, group in enumerate(optim["param_groups"]):
        for hyper in group:  # (the distributed optimizer's group step is each parameter's, as torch keeps it)
            if hyper != "step":
                expected[f"optim.param_groups.{g}.{hyper}"] = None
    assert {k for k in keys if k.startswith(("model.", "optim."))} == set(expected)
    dcp.load(expected, checkpoint_id=str(out))
    for n, t in model.items():
        _same(expected[f"model.{n}"], t, n)
    for pname, states in optim["state"].items():
        for key, value in states.items():
            _same(
                expected[f"optim.state.{pname}.{'step' if key == 'step' else key}"]
                if key != "param"
                else expected[f"model.{pname}"],
                value,
                f"{pname}.{key}",
            )
    for g, group in enumerate(optim["param_groups"]):
        assert set(expected[f"optim.param_groups.{g}.params"]) == set(group["params"])
        for hyper, value in group.items():
            if hyper not in ("step", "params"):
                got = expected[f"optim.param_groups.{g}.{hyper}"]
                assert (list(got) if isinstance(value, tuple) else got) == (
                    list(value) if isinstance(value, tuple) else value
                ), (g, hyper)


def test_biases_and_norms_are_in_the_group_without_weight_decay(tmp_path):
    out = tmp_path / "dcp"
    _convert(MCORE / "tp2_swiglu_gqa", out, "--to", "dcp")
    groups = {k: None for k in (f"optim.param_groups.{g}.{h}" for g in (0, 1) for h in ("params", "wd_mult"))}
    dcp.load(groups, checkpoint_id=str(out))
    no_wd = groups["optim.param_groups.1.params"]
    assert groups["optim.param_groups.1.wd_mult"] == 0.0 and groups["optim.param_groups.0.wd_mult"] == 1.0
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in no_wd
    assert "decoder.layers.0.mlp.linear_fc1.bias" in no_wd
    assert "decoder.layers.0.mlp.linear_fc1.weight" in groups["optim.param_groups.0.params"]


def test_torch_output_holds_the_same_state(tmp_path):
    model, optim = _truth("pp2_tied")
    out = tmp_path / "ck.pt"
    _convert(MCORE / "pp2_tied", out, "--to", "torch")
    saved = torch.load(out, weights_only=False)
    assert set(saved["model"]) == set(model)
    for n, t in model.items():
        _same(saved["model"][n], t, n)
    for pname, states in optim["state"].items():
        for key, value in states.items():
            _same(saved["optim"]["state"][pname][key], value, f"{pname}.{key}")
    assert saved["iteration"] == 2  # common.pt's values carried beside the state


def test_safetensors_output_is_the_model_per_layer(tmp_path):
    model = _model_truth("tp2_swiglu_gqa")
    out = tmp_path / "model.safetensors"
    _convert(MCORE / "tp2_swiglu_gqa", out, "--to", "safetensors")
    got = load_file(out)
    assert set(got) == set(model)
    for n, t in got.items():
        _same(t, model[n], n)


def test_flat_buffers_are_refused_in_one_sentence(tmp_path):
    source, out = MCORE / "tp2dp2_distopt", tmp_path / "out"
    scene = hostile.Scene(source, out)
    run = hostile.run_ckptkit("convert", source, out, "--to", "dcp")
    hostile.check_refused(
        run,
        str(source),
        "dp_reshardable flat buffers",
        "--dist-ckpt-optim-fully-reshardable",
        "--model-only",
        scene=scene,
    )
    assert not out.exists()


def test_the_model_alone_converts_from_flat_buffers(tmp_path):
    model = _model_truth("tp2dp2_distopt")
    out = tmp_path / "dcp"
    output = _convert(MCORE / "tp2dp2_distopt", out, "--to", "dcp", "--model-only")
    assert "not read: the optimizer (6 tensors" in output
    keys = set(dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    assert not any(k.startswith(("optim.", "optimizer.")) for k in keys)
    expected = {f"model.{n}": torch.empty_like(t) for n, t in model.items()}
    dcp.load(expected, checkpoint_id=str(out))
    for n, t in model.items():
        _same(expected[f"model.{n}"], t, n)
