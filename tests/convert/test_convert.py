"""ckptkit convert without launching a framework: every direction read back and compared with the
truth the frameworks wrote, names mapped, bad input refused in one sentence.
(tests/convert/test_convert_frameworks.py closes the loop with real FSDP2 and DeepSpeed jobs.)"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptkit.convert.names import KeyRules
from ckptkit.errors import CkptkitError, UnsupportedError, UsageError
from ckptkit.formats.registry import open_checkpoint
from ckptkit.runner.torch_archive import load_structure, open_archive
from ckptkit.ops.consolidate import consolidate
from ckptkit.ops.convert import TORCH_FILE, convert
from ckptkit.ops.diff import diff
from ckptkit.storage.source import LocalSource
from ckptkit_cli.main import cli
from conftest import DATA, assert_tensor_equal, load_truth, read_all
from helpers.convert_truth import ds_truth_from_torch, model_roles, torch_truth_from_ds
from helpers.ds_fixtures import DS_DATA, ds_fixtures

CV = DATA / "convert"
DS = ds_fixtures()
needs_ds_fixtures = pytest.mark.skipif(not DS, reason="no DeepSpeed fixtures")


def _equal_values(got: dict, want: dict, what: str) -> int:
    compared = 0
    for k, v in want.items():
        assert k in got, f"{what}: {k} missing"
        if isinstance(v, torch.Tensor):
            assert_tensor_equal(got[k], v, f"{what}: {k}")
        else:
            assert got[k] == v, f"{what}: {k} = {got[k]!r}, expected {v!r}"
        compared += 1
    return compared


# ---- names -------------------------------------------------------------------------------------


def test_key_rules():
    rules = KeyRules(strip=("model.",), renames=KeyRules.parse_renames(["layers.=blocks."]), add="net.")
    assert rules.apply("model._orig_mod.layers.0._fsdp_wrapped_module.w") == "net.blocks.0.w"
    assert rules.for_names(["module.a", "module.b"]).apply("module.a") == "net.a"
    assert KeyRules().for_names(["module.a", "b"]).apply("module.a") == "module.a"  # not every name has it
    assert KeyRules().apply("layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    with pytest.raises(UsageError, match="OLD=NEW"):
        KeyRules.parse_renames(["nothing"])


# ---- ZeRO -> DCP / torch / safetensors ---------------------------------------------------------


@needs_ds_fixtures
@pytest.mark.parametrize("name", DS)
def test_zero_to_dcp_holds_deepspeed_truth(tmp_path, name):
    convert(str(DS_DATA / name), str(tmp_path / "out"), "dcp", world_size=3)
    opened, tensors, objects = read_all(tmp_path / "out")
    assert opened.index.format == "dcp" and opened.index.world_size == 3
    cfg = json.loads((DS_DATA / name / "ds_config.json").read_text())
    want = torch_truth_from_ds(torch.load(DS_DATA / f"{name}.truth.pt", weights_only=True), cfg)
    assert _equal_values({**tensors, **objects}, want, name) >= 60
    truth = torch.load(DS_DATA / f"{name}.truth.pt", weights_only=True)
    assert objects["ds.global_steps"] == truth["global_steps"] and objects["ds.skipped_steps"] == 0
    assert objects["epoch"] == 3 and objects["note"] == "hello"  # client_state keys, at the top level
    assert "ds.lr_scheduler.last_batch_iteration" in objects
    # laid out for FSDP2 at 3 ranks: parameters and moments chunked on dim 0
    assert len(opened.index.tensors["model.embed.weight"].pieces) == 3
    assert len(opened.index.tensors["optim.state.block.fc_in.weight.exp_avg"].pieces) == 3


@needs_ds_fixtures
def test_zero_to_torch_file(tmp_path):
    convert(str(DS_DATA / "z2_bf16_w4"), str(tmp_path / "t"), "torch")
    state = torch.load(tmp_path / "t" / TORCH_FILE, weights_only=True)
    truth = torch.load(DS_DATA / "z2_bf16_w4.truth.pt", weights_only=True)
    assert set(state) >= {"model", "optim", "ds", "epoch", "note"}
    assert_tensor_equal(state["model"]["pos"], truth["fp32.pos"], "pos")
    assert_tensor_equal(state["model"]["frozen.weight"], truth["frozen.frozen.weight"].float(), "frozen")
    assert (
        state["model"]["lm_head.weight"].untyped_storage().data_ptr()
        == state["model"]["embed.weight"].untyped_storage().data_ptr()
    )  # tied: one storage
    assert_tensor_equal(state["optim"]["state"]["gate"]["exp_avg_sq"], truth["exp_avg_sq.gate"], "moment")
    assert state["optim"]["state"]["gate"]["step"] == torch.tensor(2.0)
    groups, _, _, _ = model_roles()
    assert [g["params"] for g in state["optim"]["param_groups"]] == groups
    # torch's own AdamW accepts the optimizer state as is
    model = torch.nn.ParameterDict(
        {n.replace(".", "_"): torch.nn.Parameter(state["model"][n].clone()) for ps in groups for n in ps}
    )
    params = list(model.values())
    opt = torch.optim.AdamW([{"params": params[: len(groups[0])]}, {"params": params[len(groups[0]) :]}])
    named = {n: i for i, n in enumerate(x for ps in groups for x in ps)}
    sd = {
        "state": {named[n]: s for n, s in state["optim"]["state"].items()},
        "param_groups": [dict(g, params=[named[n] for n in g["params"]]) for g in state["optim"]["param_groups"]],
    }
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == truth["lr.0"]


@needs_ds_fixtures
def test_zero_to_safetensors(tmp_path):
    convert(str(DS_DATA / "z3_fp32_w3_subgroups"), str(tmp_path / "st"), "safetensors")
    weights = load_file(str(tmp_path / "st" / "model.safetensors"))
    truth = torch.load(DS_DATA / "z3_fp32_w3_subgroups.truth.pt", weights_only=True)
    assert_tensor_equal(weights["block.fc_out.weight"], truth["fp32.block.fc_out.weight"], "w")
    assert "lm_head.weight" not in weights  # tied, written once (alias in the metadata)


# ---- DCP -> ZeRO ---------------------------------------------------------------------------------


@needs_ds_fixtures
@pytest.mark.parametrize(
    "stage,precision,world", [(1, "fp16", 3), (2, "bf16", 4), (3, "bf16", 2), (3, "fp32", 3), (2, "fp32", 1)]
)
def test_dcp_to_zero_reads_back_as_the_source(tmp_path, stage, precision, world):
    ref = f"z{stage}_{precision}_w2"
    cfg = json.loads((DS_DATA / ref / "ds_config.json").read_text())
    out = tmp_path / "zero"
    convert(
        str(CV / "fsdp2ds_w3"),
        str(out),
        f"zero{stage}",
        world_size=world,
        ds_config=str(DS_DATA / ref / "ds_config.json"),
    )
    opened, tensors, objects = read_all(out)
    assert opened.index.format == "deepspeed" and opened.index.world_size == world
    start = torch.load(CV / "fsdp2ds_w3.truth.pt", weights_only=True)
    want = ds_truth_from_torch(start, dict(cfg, train_batch_size=cfg["train_batch_size"]), {})
    groups, frozen, buffers, _ = model_roles()
    for n in [x for ps in groups for x in ps]:
        assert_tensor_equal(tensors[f"model.{n}"], want[f"fp32.{n}"], n)
        assert_tensor_equal(tensors[f"optim.state.{n}.exp_avg_sq"], want[f"exp_avg_sq.{n}"], n)
        assert objects[f"optim.state.{n}.step"] == want[f"step.{n}"]
        if stage < 3:  # low-precision module weights: the cast of the masters
            assert_tensor_equal(tensors[f"ds_module.{n}"], want[f"module.{n}"], n)
    for n in frozen:
        assert_tensor_equal(tensors[f"model.{n}"], want[f"frozen.{n}"], n)
    for b in buffers:
        assert_tensor_equal(tensors[f"model.{b}"], want[f"buffer.{b}"], b)
    assert tensors["model.lm_head.weight"].equal(tensors["model.embed.weight"])
    assert objects["ds.global_steps"] == 2 and objects["ds.global_samples"] == 2 * cfg["train_batch_size"]
    assert objects["client.extra"] == {"epoch": 3, "note": "hello"}
    assert objects["optim.param_groups.1.weight_decay"] == 0.0

    # the same files and the same entries DeepSpeed itself writes for this stage and precision
    def pattern(name: str) -> str:
        return re.sub(r"pp_rank_\d+_", "pp_rank_N_", name)

    assert {pattern(p.name) for p in (out / "global_step2").iterdir()} == {
        pattern(p.name) for p in (DS_DATA / ref / "global_step2").iterdir()
    }
    assert len(list((out / "global_step2").glob("*optim_states.pt"))) == world
    firsts = [p for p in (out / "global_step2").iterdir() if "pp_rank_0_" in p.name or p.name.startswith("mp_rank")]
    assert firsts
    for mine_f in firsts:
        a = load_structure(open_archive(LocalSource(str(mine_f.parent)), mine_f.name), eager=False)
        b = load_structure(open_archive(LocalSource(str(DS_DATA / ref / "global_step2")), mine_f.name), eager=False)
        assert set(a) - {"extra"} == set(b) - {"epoch", "note"}, mine_f.name
        if "optimizer_state_dict" in a:
            assert set(a["optimizer_state_dict"]) == set(b["optimizer_state_dict"]), mine_f.name


@needs_ds_fixtures
def test_fsdp1_and_accelerate_to_zero_and_back(tmp_path):
    for src in (DATA / "fsdp1_sharded_w2", CV / "accelerate_fsdp1_w2"):
        for precision in ("fp32", "bf16"):
            cfg = str(DS_DATA / f"z2_{precision}_w2" / "ds_config.json")
            convert(str(src), str(tmp_path / "z"), "zero2", world_size=3, ds_config=cfg)
            convert(str(tmp_path / "z"), str(tmp_path / "back"), "dcp", world_size=2)
            result = diff(str(src), str(tmp_path / "back"))
            if precision == "fp32":
                assert result.equal, src.name
            else:  # DeepSpeed keeps frozen params only in the module's precision: rounded, nothing else
                # (values only the ZeRO side keeps, e.g. ds.global_samples, are one_side: not differences)
                differ = {r.name for r in result.rows if r.status not in ("equal", "one_side")}
                assert differ <= {"frozen.weight", "frozen.bias"}
                assert diff(str(src), str(tmp_path / "back"), atol=2e-3).equal
            shutil.rmtree(tmp_path / "z")
            shutil.rmtree(tmp_path / "back")


def test_accelerate_folder_reads_as_one_checkpoint(tmp_path):
    opened, tensors, objects = read_all(CV / "accelerate_fsdp1_w2")
    truth = torch.load(CV / "accelerate_fsdp1_w2.truth.pt", weights_only=True)
    renamed = {k.replace("optimizer.", "optim.", 1): v for k, v in {**tensors, **objects}.items()}
    assert _equal_values(renamed, truth, "accelerate") >= 60


# ---- torch <-> DCP, safetensors -> DCP ---------------------------------------------------------


def test_dcp_to_torch_and_back(tmp_path):
    convert(str(DATA / "fsdp2_w2"), str(tmp_path / "t"), "torch")
    state = torch.load(tmp_path / "t" / TORCH_FILE, weights_only=True)
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    assert _equal_values(dict(flat), load_truth("fsdp2_w2"), "torch file") >= 60
    convert(str(tmp_path / "t" / TORCH_FILE), str(tmp_path / "d"), "dcp", world_size=3, expect_from="torch")
    assert diff(str(DATA / "fsdp2_w2"), str(tmp_path / "d")).equal
    _, tensors, _ = read_all(tmp_path / "d")
    assert_tensor_equal(tensors["optim.state.gate.step"], torch.tensor(2.0), "step")


def test_full_state_dict_file_to_dcp(tmp_path):
    convert(str(DATA / "fsdp1_full_state_dict.pt"), str(tmp_path / "d"), "dcp", world_size=2)
    opened, tensors, objects = read_all(tmp_path / "d")
    truth = load_truth("fsdp1_sharded_w2")
    assert _equal_values(tensors, {k: v for k, v in truth.items() if k.startswith("model.")}, "model") >= 10
    assert not any(k.startswith("optim.") for k in tensors)


def test_safetensors_to_dcp_starts_with_a_fresh_optimizer(tmp_path):
    consolidate(str(DATA / "fsdp2_w2"), str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "d"), "dcp", world_size=2)
    assert diff(str(DATA / "fsdp2_w2"), str(tmp_path / "d"), model_only=True).equal
    opened = open_checkpoint(str(tmp_path / "d"))
    assert not any(k.startswith("optim.") for k in list(opened.index.tensors) + list(opened.index.objects))


def test_wrapper_prefixes_and_renames(tmp_path):
    truth = load_truth("fsdp2_w2")
    model = {"module._orig_mod." + k[6:]: v for k, v in truth.items() if k.startswith("model.")}
    torch.save(model, tmp_path / "wrapped.pt")
    convert(str(tmp_path / "wrapped.pt"), str(tmp_path / "a"), "dcp")
    assert diff(str(DATA / "fsdp2_w2"), str(tmp_path / "a"), model_only=True).equal
    _, tensors, _ = read_all(tmp_path / "a")
    assert "model.embed.weight" in tensors
    rules = KeyRules(renames=KeyRules.parse_renames(["block.=layers.0."]), add="net.")
    convert(str(tmp_path / "wrapped.pt"), str(tmp_path / "b"), "dcp", rules=rules)
    _, tensors, _ = read_all(tmp_path / "b")
    assert "model.net.layers.0.fc_in.weight" in tensors and "model.net.embed.weight" in tensors


def test_optimizer_names_without_a_parameter_are_listed(tmp_path):
    truth = load_truth("fsdp2_w2")
    model = {k[6:]: v for k, v in truth.items() if k.startswith("model.")}
    optim = {
        "state": {"nope.weight": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}},
        "param_groups": [{"lr": 0.1, "params": ["nope.weight", "gate"]}],
    }
    torch.save({"model": model, "optim": optim}, tmp_path / "c.pt")
    with pytest.raises(UsageError, match=r"nope\.weight.*--rename"):
        convert(str(tmp_path / "c.pt"), str(tmp_path / "o"), "dcp")
    assert not (tmp_path / "o").exists()
    torch.save(
        {
            "model": model,
            "optim": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        },
        tmp_path / "ids.pt",
    )
    with pytest.raises(UnsupportedError, match="get_optimizer_state_dict"):
        convert(str(tmp_path / "ids.pt"), str(tmp_path / "o"), "dcp")


@pytest.mark.parametrize("where", ["accelerate_local_w2", "accelerate_local_w2/pytorch_model_fsdp_rank1.bin"])
def test_local_state_dict_is_refused_with_advice(tmp_path, where):
    result = CliRunner().invoke(cli, ["convert", str(CV / where), str(tmp_path / "o"), "--to", "dcp"])
    assert result.exit_code == 2
    assert "LOCAL_STATE_DICT" in result.output and "SHARDED_STATE_DICT" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()


# ---- CLI ---------------------------------------------------------------------------------------


@needs_ds_fixtures
def test_cli_convert_and_its_errors(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(
        cli,
        [
            "convert",
            str(DS_DATA / "z3_bf16_w4"),
            str(tmp_path / "d"),
            "--to",
            "dcp",
            "--world-size",
            "2",
            "--from",
            "deepspeed",
        ],
    )
    assert ok.exit_code == 0, ok.output
    assert "converted deepspeed -> dcp for 2 rank(s)" in ok.output and "2 frozen" in ok.output
    cases = [
        (["--to", "dcp", "--from", "dcp"], "not dcp (--from)"),
        (["--to", "zero2"], "--ds-config"),
        (["--to", "zero3", "--ds-config", str(tmp_path / "missing.json")], "cannot read it"),
        (["--to", "zero3", "--ds-config", str(DS_DATA / "z2_bf16_w2" / "ds_config.json")], "stage 2"),
        (["--to", "dcp", "--world-size", "0"], "at least 1"),
        (["--to", "dcp", "--rename", "x"], "OLD=NEW"),
    ]
    for args, message in cases:
        src = str(DS_DATA / "z3_bf16_w4") if args[1] == "dcp" and "--from" in args else str(CV / "fsdp2ds_w2")
        result = runner.invoke(cli, ["convert", src, str(tmp_path / "bad"), *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output and not (tmp_path / "bad").exists()
    again = runner.invoke(cli, ["convert", str(DS_DATA / "z3_bf16_w4"), str(tmp_path / "d"), "--to", "dcp"])
    assert again.exit_code == 2 and "exists" in again.output


def test_zero_stage_change_uses_the_source_config(tmp_path):
    if "z2_bf16_w2" not in DS:
        pytest.skip("no DeepSpeed fixtures")
    convert(str(DS_DATA / "z2_bf16_w2"), str(tmp_path / "z3"), "zero3", world_size=3)
    opened = open_checkpoint(str(tmp_path / "z3"))
    assert opened.index.metadata["deepspeed"]["stage"] == 3 and opened.index.world_size == 3
    assert diff(str(DS_DATA / "z2_bf16_w2"), str(tmp_path / "z3")).equal


def test_errors_are_ckptkit_errors():
    assert issubclass(UsageError, CkptkitError)


@needs_ds_fixtures
def test_frozen_glob_for_one_process_sources(tmp_path):
    """A torch.save file cannot tell frozen params from buffers by sharding: --frozen does."""
    cfg = str(DS_DATA / "z3_bf16_w2" / "ds_config.json")
    convert(str(CV / "fsdp2ds_w3"), str(tmp_path / "t"), "torch")
    src = str(tmp_path / "t" / TORCH_FILE)
    convert(src, str(tmp_path / "guess"), "zero3", world_size=2, ds_config=cfg)
    assert "frozen.weight" in open_checkpoint(str(tmp_path / "guess")).index.native.cell().buffers
    convert(src, str(tmp_path / "z"), "zero3", world_size=2, ds_config=cfg, frozen=("frozen.*",))
    info = open_checkpoint(str(tmp_path / "z")).index.native.cell()
    assert set(info.frozen) == {"frozen.weight", "frozen.bias"} and info.buffers == ["positions", "temperature"]
    convert(str(CV / "fsdp2ds_w3"), str(tmp_path / "direct"), "zero3", world_size=2, ds_config=cfg)
    assert diff(str(tmp_path / "direct"), str(tmp_path / "z")).equal


@needs_ds_fixtures
def test_dcp_to_zero3_with_small_sub_groups(tmp_path):
    """sub_group_size from the config splits each param group the way DeepSpeed does."""
    cfg = DS_DATA / "z3_fp32_w3_subgroups" / "ds_config.json"
    convert(str(CV / "fsdp2ds_w2"), str(tmp_path / "z"), "zero3", world_size=3, ds_config=str(cfg))
    opened = open_checkpoint(str(tmp_path / "z"))
    theirs = open_checkpoint(str(DS_DATA / "z3_fp32_w3_subgroups"))
    assert [[n for n, _ in g.params] for g in opened.index.native.cell().groups] == [
        [n for n, _ in g.params] for g in theirs.index.native.cell().groups
    ]  # same sub-groups at the same size
    assert len(opened.index.native.cell().groups) > 2
    assert diff(str(CV / "fsdp2ds_w2"), str(tmp_path / "z")).equal
