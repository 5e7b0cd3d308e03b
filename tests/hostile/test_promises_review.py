"""Promises a read-only review found broken, each pinned here (one section per finding).

1. a tensor a user's --tp-rules rule declares replicated must be the same on every tp rank;
2. --dtype is a strict choice;
3. a trainer checkpoint's nested state dict must be a mapping of names to tensors;
4. diff reports NaN mismatches explicitly;
5. an HF Trainer folder whose name and trainer_state.json disagree on the step is flagged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.corrupt import EXIT_ERROR, assert_error, leftovers, run_cli

ROOT = Path(__file__).resolve().parents[2]
DS_TP = ROOT / "fixtures" / "data" / "ds_tp"
DS_TP_VERSIONS = json.loads((DS_TP / "VERSIONS.json").read_text()) if (DS_TP / "VERSIONS.json").exists() else {}
MPU = sorted(n for n, f in DS_TP_VERSIONS.get("fixtures", {}).items() if f["kind"] == "mpu")
needs_tp = pytest.mark.skipif(not MPU, reason="fixtures/data/ds_tp/ not generated")


# ---- 1. replicated by a user rule -----------------------------------------------------------


def _rules_file(tmp_path: Path, rules: list[dict]) -> Path:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"rules": rules}))
    return path


def _user_replicated(pattern: str):
    from ckptkit.convert.tp_rules import TpRule, TpRules, TpSplit

    return TpRules(
        (TpRule(pattern, TpSplit("replicated", None, rule=pattern), "rules file 'r.json': rule 0"),),
        "rules file 'r.json'",
    )


def test_replicated_slices_of_different_shapes_are_refused_by_name():
    """Rank 0 [8], rank 1 [4]: a tensor whole on every rank cannot have two shapes; the rule is wrong."""
    from ckptkit.errors import CkptkitError
    from ckptkit.formats.deepspeed.model_parallel import full_entry
    from ckptkit.index.types import CheckpointIndex, FlatRange, Location, Piece, TensorEntry

    def entry(n: int) -> TensorEntry:
        return TensorEntry(
            "model.ln.weight",
            "float32",
            (n,),
            [Piece(FlatRange(0, n), Location("f", 0, 4 * n))],
            path=("model", "ln.weight"),
        )

    first = CheckpointIndex(format="deepspeed", root="r")
    first.add_tensor(entry(8))
    with pytest.raises(CkptkitError) as exc:
        full_entry([entry(8), entry(4)], "ln.weight", first, _user_replicated("ln.weight"), {}, 2, "ckpt")
    msg = str(exc.value)
    assert "model.ln.weight" in msg and "replicated" in msg
    assert "rank 0: [8]" in msg and "rank 1: [4]" in msg, msg


@needs_tp
def test_a_user_rule_replicating_a_split_tensor_is_refused(tmp_path):
    """dense_h_to_4h.weight is split along dim 0 (equal shapes, different bytes): a user rule
    calling it replicated would silently give rank 0's half as the whole tensor."""
    from ckptkit.convert.tp_rules import load_rules
    from ckptkit.errors import CkptkitError
    from ckptkit.formats.deepspeed.reader import read_index
    from ckptkit.storage.source import open_source

    rules = load_rules(str(_rules_file(tmp_path, [{"pattern": "*dense_h_to_4h.weight", "split": "replicated"}])))
    with pytest.raises(CkptkitError) as exc:
        read_index(open_source(str(DS_TP / MPU[0])), tp_rules=rules)
    msg = str(exc.value)
    assert "dense_h_to_4h.weight" in msg and "rank 1" in msg and "differs" in msg, msg


@needs_tp
def test_the_refusal_reaches_the_cli_as_one_sentence(tmp_path):
    rules = _rules_file(tmp_path, [{"pattern": "*dense_h_to_4h.weight", "split": "replicated"}])
    out = tmp_path / "out"
    res = run_cli("consolidate", DS_TP / MPU[0], out, "--tp-rules", rules)
    assert_error(res, "dense_h_to_4h.weight", code=EXIT_ERROR, out=out)
    assert not leftovers(out)


@needs_tp
def test_a_user_rule_replicating_equal_copies_reads_as_before(tmp_path):
    """Layernorms are the same on every rank: the user's rule agrees with the built-in one."""
    from ckptkit.convert.tp_rules import load_rules
    from ckptkit.formats.deepspeed.reader import read_index
    from ckptkit.storage.source import open_source

    rules = load_rules(str(_rules_file(tmp_path, [{"pattern": "*layernorm.*", "split": "replicated"}])))
    mine = read_index(open_source(str(DS_TP / MPU[0])), tp_rules=rules)
    builtin = read_index(open_source(str(DS_TP / MPU[0])), tp_rules=load_rules(None))
    key = "model.final_layernorm.weight"
    assert mine.tensors[key].pieces == builtin.tensors[key].pieces
    assert mine.tensors[key].attrs["parallel"]["tp"]["dim"] is None


@needs_tp
def test_a_user_rule_replicating_a_differing_copy_is_refused(tmp_path):
    """One bit of rank 1's layernorm master altered: the built-in rule reads rank 0's (verify
    --deep reports it), a user's rule is checked when the checkpoint is read."""
    from ckptkit.convert.tp_rules import load_rules
    from ckptkit.errors import CkptkitError
    from ckptkit.formats.deepspeed.reader import read_index
    from ckptkit.storage.source import open_source

    name = next(
        n
        for n in MPU
        if DS_TP_VERSIONS["fixtures"][n]["dtype"] == "fp32" and DS_TP_VERSIONS["fixtures"][n]["stage"] < 3
    )
    d = tmp_path / name
    shutil.copytree(DS_TP / name, d)
    index = read_index(open_source(str(d)), tp_rules=load_rules(None))
    copy = index.native.replica_entries()["model.final_layernorm.weight"][0][1]
    piece = copy.pieces[0]
    data = bytearray((d / piece.location.file).read_bytes())
    data[piece.location.offset] ^= 0x01
    (d / piece.location.file).write_bytes(bytes(data))
    read_index(open_source(str(d)), tp_rules=load_rules(None))  # built-in rule: read, verify --deep's job
    rules = load_rules(str(_rules_file(tmp_path, [{"pattern": "final_layernorm.weight", "split": "replicated"}])))
    with pytest.raises(CkptkitError) as exc:
        read_index(open_source(str(d)), tp_rules=rules)
    assert "model.final_layernorm.weight" in str(exc.value) and "rank 1" in str(exc.value)


# ---- 2. --dtype is a strict choice ----------------------------------------------------------

DTYPE_COMMANDS = ["consolidate"]  # every command with --dtype (test_every_dtype_option_is_listed checks)


def test_every_dtype_option_is_listed():
    from ckptkit_cli.main import cli

    having = sorted(name for name, cmd in cli.commands.items() if any(p.name == "dtype" for p in cmd.params))
    assert having == DTYPE_COMMANDS


@pytest.mark.parametrize("command", DTYPE_COMMANDS)
@pytest.mark.parametrize(
    "value,named",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("float64", "'float64'"),
        ("fp64", "'fp64'"),
        ("double", "'double'"),
        ("float8_e4m3fn", "'float8_e4m3fn'"),
        ("torch.fp16", "'torch.fp16'"),
    ],
)
def test_dtype_outside_the_listed_choices_is_refused(command, value, named, tmp_path):
    out = tmp_path / "OUT"
    res = run_cli(command, ROOT / "fixtures" / "data" / "fsdp2_w2", out, "--dtype", value)
    assert_error(res, "--dtype", named, out=out)
    assert not out.exists() and not leftovers(out)


def test_dtype_help_lists_exactly_the_accepted_spellings():
    """Every spelling the help lists is accepted, and the accepted set is the help's."""
    from ckptkit.index.dtypes import DTYPE_SPELLINGS, parse_dtype_option
    from ckptkit_cli.main import cli

    help_text = next(p for p in cli.commands["consolidate"].params if p.name == "dtype").help
    for spelling, name in DTYPE_SPELLINGS.items():
        assert spelling in help_text
        assert parse_dtype_option(spelling) == name
    assert set(DTYPE_SPELLINGS.values()) == {"bfloat16", "float16", "float32"}


# ---- 3. a nested state dict must be a mapping of names to tensors ----------------------------


def _save(path: Path, obj) -> Path:
    import torch

    torch.save(obj, path)
    return path


def _as_list(kind: str):
    import torch

    values = [torch.ones(2), torch.zeros(3)]
    return values if kind == "list" else tuple(values)


@pytest.mark.parametrize("kind", ["list", "tuple"])
@pytest.mark.parametrize(
    "key,name,extra",
    [
        ("state_dict", "lightning.ckpt", {"pytorch-lightning_version": "2.4.0", "global_step": 3}),  # Lightning
        ("module", "mp_rank_00_model_states.bin", {}),  # DeepSpeed's module key in a plain torch.save
        ("model", "pytorch_model.bin", {}),  # accelerate / FSDP full state dict {"model": ...}
        ("model_state_dict", "checkpoint.pt", {"epoch": 1}),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "consolidate", "convert"])
def test_a_listed_state_dict_is_refused(command, key, name, extra, kind, tmp_path):
    src = _save(tmp_path / name, {key: _as_list(kind), **extra})
    out = tmp_path / "OUT"
    args = {"inspect": [src], "consolidate": [src, out], "convert": [src, out, "--to", "torch"]}[command]
    res = run_cli(command, *args)
    assert_error(res, str(src), repr(key), "mapping", out=out)
    assert not out.exists()


def test_the_refusal_names_file_key_and_what_was_expected(tmp_path):
    from ckptkit.errors import FormatError
    from ckptkit.formats.registry import open_checkpoint

    src = _save(tmp_path / "list.ckpt", {"state_dict": _as_list("list"), "pytorch-lightning_version": "2.4.0"})
    with pytest.raises(FormatError) as exc:
        open_checkpoint(str(src))
    msg = str(exc.value)
    assert msg.startswith(f"{src}: ") and "'state_dict'" in msg and "list" in msg, msg
    assert "mapping of parameter names to tensors" in msg, msg


def test_the_reader_knows_every_model_container():
    """The reader's list of keys that hold a state dict is the one the model is found under."""
    from ckptkit.convert.keys import MODEL_CONTAINERS
    from ckptkit.formats.torch_save.reader import STATE_DICT_KEYS

    assert set(STATE_DICT_KEYS) == set(MODEL_CONTAINERS)


def test_other_lists_and_mapped_state_dicts_still_read(tmp_path):
    """Lightning's optimizer_states is a list, and a state dict as a mapping reads as before."""
    import torch
    from ckptkit.formats.registry import open_checkpoint

    src = _save(
        tmp_path / "ok.ckpt",
        {
            "state_dict": {"model.w": torch.ones(2)},
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
            "pytorch-lightning_version": "2.4.0",
        },
    )
    index = open_checkpoint(str(src)).index
    assert "state_dict.model.w" in index.tensors


# ---- 4. diff reports NaN mismatches explicitly ------------------------------------------------


def _two(
    tmp_path: Path, a: list[float], b: list[float], dtype: str = "float32", bits_b: list[int] | None = None
) -> tuple[str, str]:
    import torch
    from safetensors.torch import save_file

    ta = torch.tensor(a, dtype=getattr(torch, dtype))
    tb = torch.tensor(b, dtype=getattr(torch, dtype))
    if bits_b is not None:  # raw bit patterns (NaN payloads)
        tb = torch.tensor(bits_b, dtype=torch.int32).view(torch.float32)
    save_file({"w": ta}, str(tmp_path / "a.safetensors"))
    save_file({"w": tb}, str(tmp_path / "b.safetensors"))
    return str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")


def _row(a: str, b: str, **kw):
    from ckptkit.ops.diff import diff

    return next(r for r in diff(a, b, **kw).rows if r.name == "w")


def test_nan_against_a_number_is_counted_not_called_inf(tmp_path):
    nan = float("nan")
    row = _row(*_two(tmp_path, [1.0, nan, 3.0, nan], [1.5, 2.0, 3.0, nan]))
    assert row.status == "different"
    assert row.nan_mismatches == 1
    assert row.max_abs_diff == pytest.approx(0.5)  # over the positions both sides can compare
    assert "1 position NaN on one side only" in row.detail, row.detail


def test_nan_mismatch_is_a_difference_whatever_the_tolerance(tmp_path):
    nan = float("nan")
    row = _row(*_two(tmp_path, [1.0, nan], [1.0, 2.0]), atol=1e9)
    assert row.status == "different" and row.nan_mismatches == 1 and row.max_abs_diff == 0.0


def test_nan_in_the_same_place_with_the_same_bits_is_equal(tmp_path):
    nan = float("nan")
    row = _row(*_two(tmp_path, [1.0, nan], [1.0, nan]))
    assert row.status == "equal" and row.nan_mismatches == 0


def test_nans_of_different_bits_are_not_bit_equal(tmp_path):
    """Bitwise equality is the first criterion: two NaNs of other payloads are close, not equal."""
    import struct

    one = struct.unpack("<i", struct.pack("<f", 1.0))[0]
    row = _row(*_two(tmp_path, [1.0, float("nan")], [], bits_b=[one, 0x7FC00001]))
    assert row.status == "close" and row.nan_mismatches == 0 and row.max_abs_diff == 0.0
    assert "NaN" in row.detail and "bits" in row.detail


def test_the_same_infinity_is_no_difference(tmp_path):
    inf = float("inf")
    row = _row(*_two(tmp_path, [inf, -inf, 1.0], [inf, -inf, 2.0]))
    assert row.status == "different" and row.max_abs_diff == pytest.approx(1.0)
    row = _row(*_two(tmp_path, [inf, 1.0], [-inf, 1.0]))
    assert row.max_abs_diff == float("inf")


def test_cli_shows_and_json_carries_nan_mismatches(tmp_path):
    nan = float("nan")
    a, b = _two(tmp_path, [nan, 1.0], [2.0, 1.0])
    res = run_cli("diff", a, b)
    assert res.code == 1
    line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("different"))
    assert "NaN on one side only" in line and " inf" not in line, line
    res = run_cli("diff", "--json", a, b)
    row = next(r for r in json.loads(res.stdout)["rows"] if r["name"] == "w")
    assert row["nan_mismatches"] == 1 and row["max_abs_diff"] == 0.0
    res = run_cli("diff", "--stat", a, b)
    assert "w" in res.stdout.split("largest changes")[1]


# ---- 5. checkpoint-N whose trainer_state.json records another step ----------------------------

TRAINER_DDP = ROOT / "fixtures" / "data" / "trainer" / "ddp" / "checkpoint-2"  # global_step 2


def _trainer_copy(dst: Path, step: int | None = None) -> Path:
    shutil.copytree(TRAINER_DDP, dst)
    if step is not None:
        state = json.loads((dst / "trainer_state.json").read_text())
        state["global_step"] = step
        (dst / "trainer_state.json").write_text(json.dumps(state))
    return dst


MISMATCH = "folder name checkpoint-5 says step 5, but trainer_state.json records global_step 2"


def test_inspect_warns_when_the_folder_name_and_the_recorded_step_disagree(tmp_path):
    src = _trainer_copy(tmp_path / "checkpoint-5")
    res = run_cli("inspect", src)
    assert res.code == 0, res.output
    assert "step        2" in res.stdout  # the step the Trainer recorded
    assert f"warning     {MISMATCH}" in res.stdout, res.stdout
    doc = json.loads(run_cli("inspect", "--json", src).stdout)
    assert doc["metadata"]["hf_trainer"]["warnings"] == [MISMATCH]


def test_verify_warns_and_still_passes(tmp_path):
    src = _trainer_copy(tmp_path / "checkpoint-5")
    res = run_cli("verify", src)
    assert res.code == 0, res.output
    assert f"warning: {MISMATCH}" in res.stdout, res.stdout
    doc = json.loads(run_cli("verify", "--json", src).stdout)
    assert doc["ok"] is True and doc["summary"]["trainer"]["warnings"] == [MISMATCH]


def test_no_warning_when_they_agree_or_the_name_carries_no_step(tmp_path):
    for name in ("checkpoint-2", "my-save"):
        res = run_cli("inspect", _trainer_copy(tmp_path / name))
        assert res.code == 0 and "warning     " not in res.stdout and name in res.stdout, res.stdout
        doc = json.loads(run_cli("inspect", "--json", tmp_path / name).stdout)
        assert "warnings" not in doc["metadata"]["hf_trainer"]


def test_a_run_folder_picks_the_newest_by_folder_name_and_warns(tmp_path):
    """Like transformers' get_last_checkpoint, the newest is the largest N of checkpoint-N (here
    checkpoint-5, which records step 2, over checkpoint-3); the step shown is the recorded one, and
    the disagreement is said. --step N picks by the name too."""
    from ckptkit.formats.registry import open_checkpoint

    run = tmp_path / "out"
    run.mkdir()
    _trainer_copy(run / "checkpoint-3", step=3)
    _trainer_copy(run / "checkpoint-5")
    opened = open_checkpoint(str(run))
    assert opened.run.entry == "checkpoint-5" and opened.run.step == 2 and opened.index.step == 2
    assert opened.trainer.warnings == [MISMATCH]
    res = run_cli("inspect", run)
    assert res.code == 0 and f"warning     {MISMATCH}" in res.stdout, res.output
    res = run_cli("inspect", run, "--step", "5")
    assert res.code == 0 and "checkpoint-5" in res.output and MISMATCH in res.stdout, res.output
    res = run_cli("inspect", run, "--step", "2")
    assert res.code == EXIT_ERROR and "no checkpoint of step 2" in res.stderr, res.output


def test_the_checkpointer_never_resumes_from_a_trainer_folder(tmp_path):
    """ckptkit's Checkpointer restores only its own step_N folders: a checkpoint-N beside them,
    whatever step it records, is neither chosen nor counted as a newer incomplete step."""
    import warnings

    from conftest import saved_checkpointer_step

    ck, model, optim, _ = saved_checkpointer_step(tmp_path)
    _trainer_copy(tmp_path / "run" / "checkpoint-5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no SkippedStepsWarning for checkpoint-5
        assert ck.restore(model, optim) == 1


def test_a_listed_model_in_a_dcp_folder_is_refused(tmp_path):
    """DCP flattens a list under "model" to model.0, model.1 (accelerate's and Lightning's FSDP
    folders are DCP): refused like the torch.save file, naming the folder and the key."""
    import torch
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"model": [torch.ones(2), torch.zeros(3)]}, checkpoint_id=str(src), no_dist=True)
    out = tmp_path / "OUT"
    res = run_cli("consolidate", src, out)
    assert_error(res, str(src), "'model'", "mapping of parameter names to tensors", out=out)
    res = run_cli("inspect", src)
    assert_error(res, str(src), "'model'")
