"""A tensor that a user's --tp-rules rule declares replicated must be the same on every tp rank:
equal copies read as one tensor as before; differing copies, or slices of a tensor that is in fact
split, are refused naming the tensor (in the reader and, in one sentence, through the CLI).
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
    from ckptkit.formats.deepspeed.join_tp import full_entry
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
    from ckptkit.formats.deepspeed.read import read_index
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
    from ckptkit.formats.deepspeed.read import read_index
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
    from ckptkit.formats.deepspeed.read import read_index
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
