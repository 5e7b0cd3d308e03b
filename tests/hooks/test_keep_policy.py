"""Retention as a keep policy: `decide_retention` decides which step folders go (it marks, it never
deletes), and the Checkpointer deletes exactly the folders it marked, nothing else."""

from __future__ import annotations

import os
import shutil

import torch

import ckptkit
from ckptkit.hooks import policy
from ckptkit.hooks.policy import Retention, decide_retention
from ckptkit.hooks.steps import MARKER


def _decide(folders: dict[int, list[tuple[str, bool, bool]]], keep: int, written: int):
    """decide_retention over `folders` ({step: [(name, complete, marked)]}), and what it asked, in order."""
    names = {s: [n for n, _, _ in fs] for s, fs in folders.items()}
    facts = {(s, n): (complete, marked) for s, fs in folders.items() for n, complete, marked in fs}
    asked: list[tuple[str, int, str]] = []

    def complete(step: int, name: str) -> bool:
        asked.append(("complete", step, name))
        return facts[step, name][0]

    def marked(step: int, name: str) -> bool:
        asked.append(("marked", step, name))
        return facts[step, name][1]

    return decide_retention(names, keep, written, complete, marked), asked


def _saved(*steps: int) -> dict[int, list[tuple[str, bool, bool]]]:
    return {s: [(f"step_{s}", True, True)] for s in steps}


def test_the_newest_complete_steps_are_kept_and_the_older_marked_ones_marked():
    decided, _ = _decide(_saved(1, 2, 3, 4, 5), keep=2, written=5)
    assert decided == Retention(kept=(5, 4), newest="step_5", delete=("step_1", "step_2", "step_3"))


def test_a_newer_incomplete_folder_neither_counts_nor_goes():
    folders = _saved(1, 2, 3) | {4: [("step_4", False, False)]}
    decided, _ = _decide(folders, keep=2, written=3)
    assert decided == Retention(kept=(3, 2), newest="step_3", delete=("step_1",))


def test_the_step_just_written_is_kept_even_when_older_than_the_kept_ones():
    decided, _ = _decide(_saved(1, 2, 3, 4), keep=2, written=1)
    assert decided.kept == (4, 3) and decided.delete == ("step_2",)


def test_a_complete_folder_without_a_marker_is_never_marked():
    folders = _saved(2, 3) | {1: [("step_1", True, False)]}
    decided, _ = _decide(folders, keep=1, written=3)
    assert decided.delete == ("step_2",)


def test_every_marked_spelling_of_a_dropped_step_is_marked_and_only_those():
    folders = _saved(3) | {1: [("step_1", True, True), ("step_000000001", False, False), ("step_01", True, True)]}
    decided, _ = _decide(folders, keep=1, written=3)
    assert decided.delete == ("step_1", "step_01")


def test_nothing_complete_keeps_nothing_and_names_no_pointer():
    decided, _ = _decide({1: [("step_1", False, False)]}, keep=3, written=1)
    assert decided == Retention(kept=(), newest="", delete=())


def test_folders_are_asked_newest_first_and_no_further_than_the_decision_needs():
    """Completeness (which may open a folder from before markers) is asked only of the newest
    steps until `keep` are found; the older ones are only asked whether they are marked."""
    _, asked = _decide(_saved(1, 2, 3, 4, 5), keep=2, written=5)
    assert asked == [
        ("complete", 5, "step_5"),
        ("complete", 4, "step_4"),
        ("marked", 1, "step_1"),
        ("marked", 2, "step_2"),
        ("marked", 3, "step_3"),
    ]


def _tree(root: str) -> dict[str, int]:
    """Every file under `root` with its size: what deciding must leave as it was."""
    return {
        os.path.relpath(os.path.join(d, n), root): os.path.getsize(os.path.join(d, n))
        for d, _dirs, names in os.walk(root)
        for n in names
    }


def _run_with_steps(directory: str, *steps: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ckpt = ckptkit.Checkpointer(directory, keep=100, rng=False)
    for step in steps:
        ckpt.save(step, model)
    return model


def test_deciding_on_a_real_directory_deletes_nothing(tmp_path):
    _run_with_steps(str(tmp_path), 1, 2, 3)
    before = _tree(str(tmp_path))
    decided = policy.retention(str(tmp_path), keep=1, written=3)
    assert decided.kept == (3,) and decided.delete == ("step_000000001", "step_000000002")
    assert _tree(str(tmp_path)) == before


def test_the_checkpointer_deletes_exactly_the_marked_folders(tmp_path, monkeypatch):
    directory = str(tmp_path)
    model = _run_with_steps(directory, 1, 2, 3)
    # a complete folder from before markers, and a stray newer than every step: neither may go
    shutil.copytree(tmp_path / "step_000000001", tmp_path / "step_000000000")
    os.remove(tmp_path / "step_000000000" / MARKER)
    (tmp_path / "step_000000009").mkdir()
    decisions: list[Retention] = []
    removed: list[str] = []
    decide, remove = policy.retention, policy.remove_step_folder

    def recording_retention(*args, **kwargs):
        decisions.append(decide(*args, **kwargs))
        return decisions[-1]

    def recording_remove(directory: str, name: str) -> None:
        removed.append(name)
        remove(directory, name)

    monkeypatch.setattr(policy, "retention", recording_retention)
    monkeypatch.setattr(policy, "remove_step_folder", recording_remove)
    before = set(os.listdir(directory))
    ckptkit.Checkpointer(directory, keep=2, rng=False).save(4, model)

    assert len(decisions) == 1 and decisions[0].kept == (4, 3)
    assert removed == list(decisions[0].delete) == ["step_000000001", "step_000000002"]
    after = set(os.listdir(directory))
    assert after == (before | {"step_000000004"}) - set(removed)
    assert {"step_000000000", "step_000000009", "latest"} <= after
