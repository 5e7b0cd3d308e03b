"""DeepSpeed ZeRO reader and consolidate against real DeepSpeed checkpoints.

Truth was taken at save time through DeepSpeed's own APIs (safe_get_full_fp32_param,
safe_get_full_optimizer_state, GatheredParameters) by fixtures/generate_deepspeed.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckptkit.ops.consolidate import consolidate
from conftest import assert_tensor_equal, read_all, subprocess_env
from helpers.ds_fixtures import DS_DATA, ds_fixtures, fixture_info, needs_deepspeed, truth_key

FIXTURES = ds_fixtures()
pytestmark = pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures (run fixtures/generate_deepspeed.py)")


def _truth(name):
    return torch.load(DS_DATA / f"{name}.truth.pt", weights_only=True)


@pytest.mark.parametrize("name", FIXTURES)
def test_reader_equals_deepspeed_truth(name):
    info = fixture_info(name)
    opened, tensors, objects = read_all(DS_DATA / name)
    index = opened.index
    assert index.format == "deepspeed" and index.world_size == info["world_size"]
    assert index.metadata["deepspeed"]["stage"] == info["stage"]
    compared = 0
    for key, expected in _truth(name).items():
        kind, _, pname = key.partition(".")
        if kind == "module" and info["stage"] == 3:
            continue  # ZeRO-3 never writes the gathered low-precision weights
        ours = truth_key(kind, pname)
        if ours is None or not isinstance(expected, torch.Tensor):
            continue
        assert_tensor_equal(tensors[ours], expected, key)
        compared += 1
    assert compared >= 30
    truth = _truth(name)
    assert objects["ds.global_steps"] == truth["global_steps"] == index.step
    assert objects["client.epoch"] == 3 and objects["client.note"] == "hello"
    assert objects["optim.param_groups.0.lr"] == truth["lr.0"]
    assert index.tensors["model.lm_head.weight"].attrs["alias_of"] == "model.embed.weight"
    assert {"model.frozen.weight", "model.frozen.bias"} <= set(index.tensors)


@pytest.mark.parametrize("name", FIXTURES)
def test_consolidate_equals_truth_upcast(tmp_path, name):
    truth = _truth(name)
    res = consolidate(str(DS_DATA / name), str(tmp_path / "out"))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert res.aliases == {"lm_head.weight": "embed.weight"}
    for key, expected in truth.items():
        kind, _, pname = key.partition(".")
        if kind in ("fp32", "frozen", "buffer"):
            want = expected.float() if expected.is_floating_point() else expected
            assert_tensor_equal(out[pname], want, key)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["ckptkit.aliases"]) == {"lm_head.weight": "embed.weight"}


ZERO_TO_FP32 = r"""
import json, sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
out = {}
for name, path in json.loads(sys.argv[1]).items():
    sd = get_fp32_state_dict_from_zero_checkpoint(path)
    out[name] = {k: (v.contiguous() if hasattr(v, "contiguous") else v).clone() for k, v in sd.items()}
torch.save(out, sys.argv[2])
"""


@needs_deepspeed
def test_consolidate_equals_zero_to_fp32(tmp_path):
    """Bit for bit what DeepSpeed's zero_to_fp32 returns, on every key it returns."""
    paths = {n: str(DS_DATA / n) for n in FIXTURES}
    env = {**subprocess_env(), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", ZERO_TO_FP32, json.dumps(paths), str(tmp_path / "z.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs_all = torch.load(tmp_path / "z.pt", weights_only=True)
    for name in FIXTURES:
        consolidate(str(DS_DATA / name), str(tmp_path / name))
        _, ours, _ = read_all(tmp_path / name)  # aliases restored from our metadata
        theirs = theirs_all[name]
        for key, value in theirs.items():
            want = value.float() if value.is_floating_point() else value  # theirs keeps frozen in bf16/fp16
            assert_tensor_equal(ours[key], want, f"{name}:{key}")
        missing = set(ours) - set(theirs)
        if fixture_info(name)["stage"] == 1:
            assert missing == {"frozen.weight", "frozen.bias"}, missing  # zero_to_fp32 drops them at stage 1
        else:
            assert not missing, missing


def test_reading_needs_no_deepspeed(tmp_path):
    """Reader, consolidate and reshard run with deepspeed made unimportable: no pickled code runs."""
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from ckptkit.ops.consolidate import consolidate\n"
        "from ckptkit.ops.reshard import reshard\n"
        f"consolidate({str(DS_DATA / FIXTURES[0])!r}, {str(tmp_path / 'o')!r})\n"
        f"reshard({str(DS_DATA / FIXTURES[-1])!r}, {str(tmp_path / 'r')!r}, 2)\n"
        "assert 'deepspeed' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _copy(name, tmp_path):
    import shutil

    dst = tmp_path / name
    shutil.copytree(DS_DATA / name, dst)
    return dst


@pytest.mark.parametrize(
    "case,message",
    [
        # a model-parallel rank's model file without its optim files (tensor parallelism is read:
        # tests/formats/deepspeed/test_ds_tp*.py)
        ("mp_rank_01", r"no \*_optim_states.pt files of model-parallel rank 1"),
        ("expert", "mixture-of-experts"),
        ("offloaded", "NVMe-offloaded"),
        ("missing_rank", r"optim-states files for rank\(s\) \[0\] are missing"),
        ("bad_latest", "tag folder is missing"),
    ],
)
def test_unsupported_and_broken_layouts_are_named(tmp_path, case, message):
    from ckptkit.errors import CkptkitError
    from ckptkit.formats.registry import open_checkpoint

    d = _copy("z2_bf16_w2" if "z2_bf16_w2" in FIXTURES else FIXTURES[0], tmp_path)
    tag = d / "global_step2"
    if case == "mp_rank_01":
        (tag / "mp_rank_01_model_states.pt").write_bytes((tag / "mp_rank_00_model_states.pt").read_bytes())
    elif case == "expert":
        (tag / "layer_0_expert_0_mp_rank_00_model_states.pt").write_bytes(b"x")
    elif case == "offloaded":
        (tag / "offloaded_tensors").mkdir()
    elif case == "missing_rank":
        next(tag.glob("*zero_pp_rank_0_*optim_states.pt")).unlink()
    elif case == "bad_latest":
        (d / "latest").write_text("global_step9")
    with pytest.raises(CkptkitError, match=message):
        open_checkpoint(str(d))


def test_tag_option_and_tag_folder(tmp_path):
    from click.testing import CliRunner

    from ckptkit_cli.main import cli

    name = FIXTURES[0]
    runner = CliRunner()
    for args in (
        ["inspect", str(DS_DATA / name / "global_step2")],
        ["inspect", "--tag", "global_step2", str(DS_DATA / name)],
    ):
        res = runner.invoke(cli, args)
        assert res.exit_code == 0, res.output
        assert "format      deepspeed" in res.output and "step        2" in res.output
    res = runner.invoke(cli, ["inspect", "--tag", "global_step7", str(DS_DATA / name)])
    assert res.exit_code == 2 and "global_step7" in res.output and "Traceback" not in res.output


def test_consolidate_dtype_bf16_casts_the_masters(tmp_path):
    name = "z2_fp16_w2" if "z2_fp16_w2" in FIXTURES else FIXTURES[0]
    truth = _truth(name)
    consolidate(str(DS_DATA / name), str(tmp_path / "out"), dtype="bfloat16")
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    for key, expected in truth.items():
        kind, _, pname = key.partition(".")
        if kind in ("fp32", "frozen", "buffer"):
            want = expected.to(torch.bfloat16) if expected.is_floating_point() else expected
            assert_tensor_equal(out[pname], want, key)


def test_flat_pieces_refuse_a_parameter_whose_ranks_disagree_on_its_dtype():
    """_FlatPieces.add checks a parameter's dtype against the other ranks' only where its state
    key has held another dtype: every such parameter is still refused, the first in slot order,
    with the dtype of each side; parameters of different dtypes that never meet pass."""
    from types import SimpleNamespace

    from ckptkit.errors import FormatError
    from ckptkit.formats.deepspeed.flat_groups import _FlatPieces
    from ckptkit.formats.deepspeed.partition import stage3_shares
    from ckptkit.index.types import FlatRange, Location

    def add(flats, names, rank, what, dtype, world=2):
        share = stage3_shares([(n, 8) for n in names], world)[rank]
        ranges = [FlatRange(s.start, s.length) for s in share.slots]
        flats.add(SimpleNamespace(label=f"rank{rank}.pt"), share, what, dtype, Location(f"r{rank}", 0, 64), ranges)

    flats = _FlatPieces()
    add(flats, ["a", "b", "c"], 0, None, "float32")
    with pytest.raises(FormatError, match=r"^rank1\.pt: model\.b is 'float16' here, 'float32' on another rank$"):
        add(flats, ["b", "c"], 1, None, "float16")

    flats = _FlatPieces()
    add(flats, ["a"], 0, "exp_avg", "float32")
    add(flats, ["x", "y"], 0, "exp_avg", "float16")  # other parameters: no disagreement
    add(flats, ["a"], 1, "exp_avg", "float32")
    with pytest.raises(
        FormatError,
        match=r"^rank1\.pt: optim\.state\.y\.exp_avg is 'float32' here, "
        r"'float16' on another rank$",
    ):
        add(flats, ["a", "y", "x"], 1, "exp_avg", "float32")

    flats = _FlatPieces()
    flats.ensure("z", "exp_avg", "float16")  # a zero-size parameter's (empty) state
    add(flats, ["w"], 0, "exp_avg", "float32")
    with pytest.raises(FormatError, match=r"optim\.state\.z\.exp_avg is 'float32' here, 'float16' on another"):
        add(flats, ["z"], 1, "exp_avg", "float32")
