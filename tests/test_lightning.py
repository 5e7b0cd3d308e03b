"""Lightning's checkpoints (fixtures/generate_lightning.py: real Lightning runs on CPU).

Truth comes from Lightning itself, at test time: its own consolidation of the FSDP sharded
checkpoint (`_load_distributed_checkpoint` + `_format_checkpoint`, what
`python -m lightning.pytorch.utilities.consolidate_checkpoint` runs), its DeepSpeed one
(`convert_zero_checkpoint_to_fp32_state_dict`), torch.load of the .ckpt files (test code may), and
the parameter order each run recorded (the optimizer's params matched by identity to the
LightningModule's named_parameters, in <name>.fixture.json).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import DATA
from helpers_corrupt import run_cli

from ckptkit.formats import lightning
from ckptkit.formats.registry import open_checkpoint
from ckptkit.ops.consolidate import consolidate
from ckptkit.ops.inspect import inspect
from ckptkit.ops.keys import split_roles

pytest.importorskip("lightning", reason="the Lightning tests take truth from Lightning's own consolidation")
LT = DATA / "lightning"
FSDP, SINGLE, GROUPS, DS = (LT / n for n in ("fsdp_sharded_w2", "single_w1.ckpt", "groups_w1.ckpt", "deepspeed_z2_w2"))
PREFIX = "model."  # the LightningModule holds the network as self.model


def info(path) -> dict:
    return json.loads((LT / f"{path.name}.fixture.json").read_text())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: bits differ"


@pytest.fixture(scope="module")
def fsdp_truth() -> dict:
    """Lightning's own consolidation of the FSDP sharded checkpoint."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    return _format_checkpoint(_load_distributed_checkpoint(FSDP))


def strip(name: str) -> str:
    assert name.startswith(PREFIX), name
    return name[len(PREFIX):]


def read_optimizer(folder) -> tuple[dict, dict]:
    tensors = load_file(str(folder / "optimizer.safetensors"))
    with safe_open(str(folder / "optimizer.safetensors"), "pt") as f:
        objects = json.loads(f.metadata()["ckptkit.objects"])
    return tensors, objects


@pytest.mark.parametrize("path", [FSDP, SINGLE, GROUPS, DS], ids=lambda p: p.name)
def test_inspect_counts_optimizer_and_shows_lightning_step(path):
    _, report = inspect(str(path))
    assert report.roles["model"] == 21
    # torch AdamW: exp_avg, exp_avg_sq and a 0-d step tensor per parameter; DeepSpeed keeps the step apart
    assert report.roles["optimizer"] == (42 if path == DS else 63)
    assert report.roles["other"] == 0
    assert report.step == info(path)["global_step"] == 2
    assert any("Lightning checkpoint" in n for n in report.notes)


def test_inspect_cli_prints_step_and_roles():
    res = run_cli("inspect", str(FSDP))
    assert res.code == 0, res.output
    assert "step        2" in res.stdout
    assert "21 model, 63 optimizer, 0 other" in res.stdout


def test_fsdp_consolidate_include_optimizer_matches_lightning(tmp_path, fsdp_truth):
    out = tmp_path / "out"
    res = consolidate(str(FSDP), str(out), include_optimizer=True)
    assert any("stripped model." in n for n in res.notes)
    model = load_file(str(out / "model.safetensors"))
    truth_model = fsdp_truth["state_dict"]
    assert sorted(model) == sorted(strip(k) for k in truth_model)
    for k, v in truth_model.items():
        same(model[strip(k)], v, k)
    tensors, objects = read_optimizer(out)
    (opt,) = fsdp_truth["optimizer_states"]
    assert len(tensors) == sum(len(s) for s in opt["state"].values()) == 63
    for name, states in opt["state"].items():
        for key, value in states.items():
            same(tensors[f"state.{strip(name)}.{key}"], value, f"{name}.{key}")
    (group,) = opt["param_groups"]
    assert objects["param_groups.0.params"] == [strip(n) for n in group["params"]]
    for hyper, value in group.items():
        if hyper != "params":
            assert objects[f"param_groups.0.{hyper}"] == (list(value) if isinstance(value, tuple) else value), hyper


def test_fsdp_consolidated_names_are_the_networks_own(tmp_path):
    """The stripped names load into the network itself (a LlamaForCausalLM like the run's), strictly."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "out"
    consolidate(str(FSDP), str(out))
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    net = transformers.LlamaForCausalLM(cfg)
    missing, unexpected = net.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    assert not missing and not unexpected


def test_fsdp_convert_to_torch_carries_optimizer(tmp_path, fsdp_truth):
    out = tmp_path / "c.pt"
    res = run_cli("convert", str(FSDP), str(out), "--to", "torch")
    assert res.code == 0, res.output
    assert "21 trainable, 0 frozen" in res.stdout, res.stdout
    got = torch.load(out, weights_only=False)
    for k, v in fsdp_truth["state_dict"].items():
        same(got["model"][k], v, k)
    (opt,) = fsdp_truth["optimizer_states"]
    assert sorted(got["optim"]["state"]) == sorted(opt["state"])
    for name, states in opt["state"].items():
        for key, value in states.items():
            same(got["optim"]["state"][name][key], value, f"{name}.{key}")
    assert got["optim"]["param_groups"][0]["params"] == opt["param_groups"][0]["params"]
    assert got["global_step"] == fsdp_truth["global_step"] == 2  # meta.pt's values travel as extras


def test_single_file_numbers_named_by_the_proven_rule(tmp_path):
    order = info(SINGLE)["optimizer_order"]
    assert len(order) == 1
    split = split_roles(open_checkpoint(str(SINGLE)).index)
    assert split.named_by_order == ["optimizer_0"] and not split.numbered
    assert split.optim_values["param_groups.0.params"] == order[0]   # what the run's optimizer held
    out = tmp_path / "out"
    res = consolidate(str(SINGLE), str(out), include_optimizer=True)
    assert any("named from the model's order" in n for n in res.notes)
    truth = torch.load(SINGLE, weights_only=False)["optimizer_states"][0]
    tensors, objects = read_optimizer(out)
    assert objects["param_groups.0.params"] == [strip(n) for n in order[0]]
    for number, states in truth["state"].items():
        for key, value in states.items():
            same(tensors[f"state.{strip(order[0][number])}.{key}"], value, f"{number}.{key}")


def test_two_groups_stay_numbered_and_say_why(tmp_path):
    order = info(GROUPS)["optimizer_order"]
    flat = [n for g in order for n in g]
    model_order = list(torch.load(GROUPS, weights_only=False)["state_dict"])
    assert flat != model_order  # naming numbers by the model's order would have been wrong here
    split = split_roles(open_checkpoint(str(GROUPS)).index)
    assert "2 param groups" in split.numbered["optimizer_0"] and not split.named_by_order
    out = tmp_path / "out"
    res = consolidate(str(GROUPS), str(out), include_optimizer=True)
    assert any("kept by parameter number" in n for n in res.notes)
    truth = torch.load(GROUPS, weights_only=False)["optimizer_states"][0]
    tensors, objects = read_optimizer(out)
    assert objects["param_groups.1.params"] == truth["param_groups"][1]["params"]
    for number, states in truth["state"].items():
        for key, value in states.items():
            same(tensors[f"state.{number}.{key}"], value, f"{number}.{key}")


@pytest.mark.parametrize("path", [SINGLE, GROUPS], ids=lambda p: p.name)
def test_single_file_convert_never_drops_the_optimizer(tmp_path, path):
    """Either the optimizer arrives under names (every moment equal), or one sentence, exit non-zero."""
    out = tmp_path / "c.pt"
    res = run_cli("convert", str(path), str(out), "--to", "torch")
    if res.code != 0:
        assert res.exception is None and "Traceback" not in res.output
        assert res.stderr.strip().count("\n") == 0, res.stderr
        return
    assert path == SINGLE, "numbers that cannot be proven must not be converted to names"
    order = info(path)["optimizer_order"][0]
    truth = torch.load(path, weights_only=False)["optimizer_states"][0]
    got = torch.load(out, weights_only=False)["optim"]["state"]
    for number, states in truth["state"].items():
        for key, value in states.items():
            same(got[order[number]][key], value, f"{number}.{key}")


def test_deepspeed_layout_matches_lightnings_own_conversion(tmp_path, capsys):
    pytest.importorskip("deepspeed", reason="Lightning's DeepSpeed conversion needs deepspeed")
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    truth = convert_zero_checkpoint_to_fp32_state_dict(DS, tmp_path / "lightning.pt")
    out = tmp_path / "out"
    res = consolidate(str(DS), str(out), include_optimizer=True)
    assert any("stripped model." in n for n in res.notes)
    model = load_file(str(out / "model.safetensors"))
    assert sorted(model) == sorted(strip(k) for k in truth["state_dict"])
    for k, v in truth["state_dict"].items():
        same(model[strip(k)], v, k)
    tensors, _ = read_optimizer(out)
    assert sorted(k for k in tensors if k.endswith(".exp_avg")) == sorted(f"state.{strip(k)}.exp_avg"
                                                                         for k in truth["state_dict"])
    _, report = inspect(str(DS))
    assert report.step == truth["global_step"] == 2  # Lightning's, from the client state


def test_meta_pt_the_unpickler_refuses_is_one_sentence(tmp_path):
    """A meta.pt holding a class the restricted unpickler does not know (a hyperparameter object):
    model and optimizer are still read, and the refusal is said once."""
    import argparse

    folder = tmp_path / "ckpt"
    shutil.copytree(FSDP, folder)
    meta = torch.load(FSDP / lightning.META, weights_only=False)
    meta["hyper_parameters"] = {"args": argparse.Namespace(lr=0.01)}
    torch.save(meta, folder / lightning.META)
    _, report = inspect(str(folder))
    assert report.roles == {"model": 21, "optimizer": 63, "other": 0, "low_precision": 0}
    (note,) = [n for n in report.notes if n.startswith("not read")]
    assert "argparse.Namespace" in note and "meta.pt" in note
    assert report.step is None
    res = consolidate(str(folder), str(tmp_path / "out"), include_optimizer=True)
    assert res.optimizer_tensors == 63
    assert any(n.startswith("not read") and "argparse.Namespace" in n for n in res.not_written)


def test_model_prefix_only_when_every_name_shares_it():
    assert lightning.model_prefix(["model.a.weight", "model.b"]) == "model."
    assert lightning.model_prefix(["model.a.weight", "head.b"]) is None
    assert lightning.model_prefix(["_forward_module.net.a", "_forward_module.net.b"]) == "_forward_module.net."
    assert lightning.model_prefix(["weight"]) is None


def test_dcp_part_resharded_with_meta_copied_is_what_lightning_reads(tmp_path, fsdp_truth):
    """formats.lightning.dcp_part is what a reshard of the folder needs: the DCP part written for 3
    ranks and meta.pt copied byte for byte read back through Lightning's own loader as the source."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    from ckptkit.formats.dcp.writer import write_dcp
    from ckptkit.index.layouts import fsdp2_layout
    from ckptkit.runner.fetch import Fetcher
    from ckptkit.storage.output import OutputDir

    opened = open_checkpoint(str(FSDP))
    part, copies = lightning.dcp_part(opened.index)
    assert copies == [lightning.META] and len(part.tensors) == 84
    assert not any(o.attrs.get(lightning.META_ATTR) for o in part.objects.values())
    out = tmp_path / "w3"
    with OutputDir(str(out)) as target:
        write_dcp(target, part, Fetcher(opened.source), fsdp2_layout(part, 3), slab_bytes=1 << 20)
        for name in copies:
            target.write_bytes(name, (FSDP / name).read_bytes())
    got = _format_checkpoint(_load_distributed_checkpoint(out))
    assert sorted(got) == sorted(fsdp_truth)
    for k, v in fsdp_truth["state_dict"].items():
        same(got["state_dict"][k], v, k)
    for name, states in fsdp_truth["optimizer_states"][0]["state"].items():
        for key, value in states.items():
            same(got["optimizer_states"][0]["state"][name][key], value, f"{name}.{key}")
    assert got["global_step"] == 2 and got["loops"] == fsdp_truth["loops"]


def test_lightnings_consolidated_ckpt_is_read_by_name(tmp_path, fsdp_truth):
    """The .ckpt `python -m lightning.pytorch.utilities.consolidate_checkpoint` writes (torch.save of
    the formatted dict) keys optimizer_states by name: read as they are, no numbering rule needed."""
    ckpt = tmp_path / "consolidated.ckpt"
    torch.save(fsdp_truth, ckpt)
    split = split_roles(open_checkpoint(str(ckpt)).index)
    assert not split.numbered and not split.named_by_order
    out = tmp_path / "out"
    consolidate(str(ckpt), str(out), include_optimizer=True)
    tensors, _ = read_optimizer(out)
    for name, states in fsdp_truth["optimizer_states"][0]["state"].items():
        for key, value in states.items():
            same(tensors[f"state.{strip(name)}.{key}"], value, f"{name}.{key}")
    _, report = inspect(str(ckpt))
    assert report.step == 2 and report.roles["optimizer"] == 63


def test_optimizer_parts_names_both_lightning_layouts_alike():
    from ckptkit.ops.keys import OPTIM_CONTAINERS, optimizer_parts

    assert optimizer_parts(("optimizer_0", "state", "w", "exp_avg")) == ("optimizer_0", ("state", "w", "exp_avg"))
    assert optimizer_parts(("optimizer_states", 1, "state", "3", "exp_avg")) == ("optimizer_1", ("state", "3", "exp_avg"))
    assert optimizer_parts(("optim", "param_groups", 0, "lr")) == ("optim", ("param_groups", 0, "lr"))
    assert optimizer_parts(("model", "w")) is None and optimizer_parts(("optimizer_x", "w")) is None
    assert "optimizer_12" in OPTIM_CONTAINERS and "optimizer_states" in OPTIM_CONTAINERS
    assert "optimizer_" not in OPTIM_CONTAINERS and 0 not in OPTIM_CONTAINERS
