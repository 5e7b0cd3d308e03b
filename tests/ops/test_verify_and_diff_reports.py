"""verify and diff as users expect them, through `python -m ckptkit` in a subprocess.

verify lists every problem (a truncated rank file AND a missing one), each with its file, key and
kind, as text and as strict JSON. diff compares extras and the step besides tensors, gives each
tensor's max |a-b| and relative L2 change (checked against torch here), and `--stat` puts the
largest relative changes first. Exit codes: verify 0/1, diff 0 equal / 1 different.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from helpers.ds_fixtures import DS_DATA, ds_fixtures
from helpers.corrupt import DATA, run_subprocess, truncate_half


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (RFC 8259)."""

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


# ---- verify: every problem, with its file, key and kind ----------------------------------------


@pytest.fixture
def dcp_two_damages(tmp_path):
    """fsdp2_w3 with rank 1's data file cut in half and rank 2's removed."""
    d = tmp_path / "dcp"
    shutil.copytree(DATA / "fsdp2_w3", d)
    truncate_half(d / "__1_0.distcp")
    (d / "__2_0.distcp").unlink()
    return d


@pytest.fixture
def ds_two_damages(tmp_path):
    """A ZeRO-2 checkpoint of 4 ranks with rank 1's optim-states file cut short and rank 2's removed."""
    if "z2_bf16_w4" not in ds_fixtures():
        pytest.skip("no DeepSpeed fixtures")
    d = tmp_path / "ds"
    shutil.copytree(DS_DATA / "z2_bf16_w4", d)
    tag = d / "global_step2"
    truncate_half(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    return d


def _by_kind(doc: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in doc["problems"]:
        assert set(p) == {"file", "key", "kind", "message"}, p
        out.setdefault(p["kind"], []).append(p)
    return out


def test_verify_json_lists_a_truncated_and_a_missing_dcp_rank_file(dcp_two_damages):
    res = run_subprocess("verify", "--json", str(dcp_two_damages))
    assert res.code == 1, res.stderr
    doc = strict_json(res.stdout)
    assert doc["ok"] is False and doc["path"] == str(dcp_two_damages)
    kinds = _by_kind(doc)
    missing, cut = kinds.get("missing_file", []), kinds.get("truncated", [])
    assert [p["file"] for p in missing] == [str(dcp_two_damages / "__2_0.distcp")]  # once, however many items
    assert missing[0]["key"] is None
    assert cut and all(p["file"] == str(dcp_two_damages / "__1_0.distcp") and p["key"] for p in cut)
    # items cut off are named by key, each once; their tensors are not reported again as gaps
    assert len({p["key"] for p in cut}) == len(cut)
    assert not {p["key"] for p in kinds.get("coverage_gap", [])} & {p["key"] for p in cut}
    assert doc["summary"]["problems"] == len(doc["problems"])
    assert doc["summary"]["by_kind"]["missing_file"] == 1 and doc["summary"]["format"] == "dcp"


def test_verify_json_lists_a_truncated_and_a_missing_deepspeed_rank_file(ds_two_damages):
    for deep in ((), ("--deep",)):
        res = run_subprocess("verify", "--json", *deep, str(ds_two_damages))
        assert res.code == 1, res.stderr
        doc = strict_json(res.stdout)
        tag = ds_two_damages / "global_step2"
        found = {(p["kind"], p["file"], p["key"]) for p in doc["problems"]}
        assert found == {
            ("missing_file", str(tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"), None),
            ("truncated", str(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"), None),
        }, doc
        assert doc["summary"]["format"] == "deepspeed" and doc["summary"]["deep"] is bool(deep)


def test_verify_text_lists_both_problems(dcp_two_damages, ds_two_damages):
    res = run_subprocess("verify", str(dcp_two_damages))
    assert res.code == 1 and res.stdout == ""
    assert "missing_file: " + str(dcp_two_damages / "__2_0.distcp") in res.stderr, res.stderr
    assert "truncated: " + str(dcp_two_damages / "__1_0.distcp") in res.stderr, res.stderr
    res = run_subprocess("verify", str(ds_two_damages))
    assert res.code == 1
    lines = res.stderr.splitlines()
    assert lines[0] == f"{ds_two_damages}: 2 problem(s) found", res.stderr
    assert "missing_file" in lines[1] and "rank_2" in lines[1] and "truncated" in lines[2] and "rank_1" in lines[2]
    assert "Traceback" not in res.stderr


def test_verify_json_on_a_sound_checkpoint_and_quiet_after_the_command():
    res = run_subprocess("verify", "--json", str(DATA / "fsdp2_w2"))
    assert res.code == 0, res.stderr
    doc = strict_json(res.stdout)
    assert doc["ok"] is True and doc["problems"] == [] and doc["summary"]["tensors"] > 0
    res = run_subprocess("verify", str(DATA / "fsdp2_w2"), "-q")
    assert res.code == 0 and res.stdout == "" and res.stderr == ""
    res = run_subprocess("verify", "--json", str(DATA / "no_such_checkpoint"))
    assert res.code == 1
    doc = strict_json(res.stdout)
    assert [(p["kind"], p["key"]) for p in doc["problems"]] == [("not_a_checkpoint", None)]


# ---- diff: tensors with norms, extras, step, --stat --------------------------------------------


def _save(path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two DCP checkpoints a step apart: w changes a lot, b a little, c not at all; the
    scheduler's last_epoch goes 4 -> 5 and the step 4 -> 5."""
    root = tmp_path_factory.mktemp("runs")
    gen = torch.Generator().manual_seed(0)
    wa, ba, c = torch.randn(64, 32, generator=gen), torch.randn(32, generator=gen), torch.randn(8, generator=gen)
    wb = wa + 0.5 * torch.randn(64, 32, generator=gen)
    bb = ba.clone()
    bb[3] += 0.01
    a = {"model": {"w": wa, "b": ba, "c": c}, "extra": {"scheduler": {"last_epoch": 4}}, "step": 4}
    b = {"model": {"w": wb, "b": bb, "c": c.clone()}, "extra": {"scheduler": {"last_epoch": 5}}, "step": 5}
    _save(root / "a", a)
    _save(root / "b", b)
    _save(
        root / "a_again",
        {"model": {k: v.clone() for k, v in a["model"].items()}, "extra": {"scheduler": {"last_epoch": 4}}, "step": 4},
    )
    return root, a["model"], b["model"]


def _truth(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    x64, y64 = x.to(torch.float64), y.to(torch.float64)
    return float((x64 - y64).abs().max()), float(torch.linalg.vector_norm(x64 - y64) / torch.linalg.vector_norm(x64))


def test_diff_reports_tensors_with_norms_extras_and_step(two_runs):
    root, ma, mb = two_runs
    res = run_subprocess("diff", "--json", root / "a", root / "b")
    assert res.code == 1, res.stderr
    doc = strict_json(res.stdout)
    rows = {r["name"]: r for r in doc["rows"]}
    for name in ("w", "b"):
        max_abs, rel = _truth(ma[name], mb[name])
        assert rows[name]["status"] == "different"
        assert rows[name]["max_abs_diff"] == pytest.approx(max_abs, rel=1e-12)
        assert rows[name]["rel_l2"] == pytest.approx(rel, rel=1e-9)
    assert rows["c"]["status"] == "equal" and rows["c"]["rel_l2"] == 0.0
    epoch = rows["extra:extra.scheduler.last_epoch"]
    assert epoch["status"] == "different" and epoch["detail"] == "4 vs 5" and epoch["max_abs_diff"] == 1
    assert epoch["rel_l2"] == pytest.approx(0.25)
    assert rows["step"]["status"] == "different" and rows["step"]["detail"] == "4 vs 5"
    assert doc["equal"] is False and doc["counts"] == {"different": 4, "equal": 1}

    text = run_subprocess("diff", root / "a", root / "b")
    assert text.code == 1
    lines = text.stdout.splitlines()
    assert lines[:3] == [f"a: {root / 'a'}", f"b: {root / 'b'}", "compared 4 different, 1 equal"]
    max_abs, rel = _truth(ma["w"], mb["w"])
    assert f"  different w  max |a-b| {max_abs:.6g}  rel L2 {rel:.6g}" in lines
    assert "  different extra:extra.scheduler.last_epoch  max |a-b| 1  rel L2 0.25  (4 vs 5)" in lines
    assert "  different step  max |a-b| 1  rel L2 0.25  (4 vs 5)" in lines
    assert "not equal" in lines


def test_diff_stat_puts_the_largest_relative_change_first(two_runs):
    root, ma, mb = two_runs
    res = run_subprocess("diff", "--stat", root / "a", root / "b", "-q")
    assert res.code == 1, res.stderr
    lines = res.stdout.splitlines()
    assert lines[2] == "compared 4 different, 1 equal"
    start = next(i for i, line in enumerate(lines) if line.startswith("largest changes"))
    table = [line.split() for line in lines[start + 2 :] if line.startswith("  ")]
    names = [row[3] for row in table]  # rel L2, max |a-b|, status, name[, (detail)]
    assert names == ["w", "extra:extra.scheduler.last_epoch", "step", "b"], lines  # ties by name
    rels = [float(row[0]) for row in table]
    assert rels == sorted(rels, reverse=True)
    assert rels[0] == pytest.approx(_truth(ma["w"], mb["w"])[1], rel=1e-5)
    assert "c" not in names and lines[-1] == "not equal"
    doc = strict_json(run_subprocess("diff", "--stat", "--json", root / "a", root / "b").stdout)
    assert doc["largest"] == names


def test_diff_of_equal_checkpoints_exits_0(two_runs):
    root, _, _ = two_runs
    res = run_subprocess("diff", root / "a", root / "a_again", "-q")
    assert res.code == 0, res.output
    assert "compared 5 equal" in res.stdout and "equal" in res.stdout.splitlines()
    res = run_subprocess("diff", "--stat", root / "a", root / "a_again")
    assert res.code == 0 and "largest changes" not in res.stdout


def test_diff_model_only_leaves_extras_and_step_out(two_runs):
    root, _, _ = two_runs
    doc = strict_json(run_subprocess("diff", "--json", "--model-only", root / "a", root / "b").stdout)
    assert sorted(r["name"] for r in doc["rows"]) == ["b", "c", "w"]
    assert not math.isnan(doc["rows"][0]["rel_l2"])
