"""An HF Trainer folder whose name (checkpoint-N) and trainer_state.json disagree on the step:
inspect and verify warn (verify still passes), a run folder picks the newest by folder name and
says so, and the Checkpointer never resumes from a trainer folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


from helpers.corrupt import EXIT_ERROR, run_cli

ROOT = Path(__file__).resolve().parents[3]


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
