"""Hostile run folders and consolidate's side files: an entry linked out of the run folder or back to
it, entry names that are not ASCII digits, FIFOs and saves in progress, thousands of links or
broken saves (at a bounded cost), a global_step that is not a count, a trainer_state.json or
config.json that parses into gigabytes, a --config that is no folder or file, and an OUT that is or
holds a side file consolidate copies.

Each case is crafted from the real fixtures the way an attacker or a careless user would break
them, run through the CLI in a subprocess (tests/helpers/hostile.py) and held to the contract of
docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers.hostile import Scene, check_refused, rss_bound, run_ckptkit

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fixtures" / "data"
TRAINER = DATA / "trainer" / "ds_z2" / "checkpoint-2"
LIGHTNING = DATA / "lightning" / "single_w1.ckpt"
TIMEOUT = 30.0
BUDGET = 64 << 20


def _entry(run: Path, n: int, name: str | None = None) -> Path:
    """checkpoint-N: a real Trainer checkpoint (files hard-linked, not copied), global_step N."""
    ckpt = run / (name or f"checkpoint-{n}")
    shutil.copytree(TRAINER, ckpt, copy_function=os.link)
    state = ckpt / "trainer_state.json"
    doc = json.loads(state.read_text())
    doc["global_step"] = n
    state.unlink()  # a file of its own, not a link to the fixture's
    state.write_text(json.dumps(doc))
    return ckpt


def _run_folder(tmp_path: Path, steps=(1, 2)) -> Path:
    run = tmp_path / "output_dir"
    run.mkdir()
    for n in steps:
        _entry(run, n)
    return run


# ---- run folders ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pick", [("--step", "9"), ("--tag", "epoch=0-step=9.ckpt")])
def test_an_entry_linked_outside_is_not_read_when_asked_for(tmp_path: Path, pick) -> None:
    # Without this check: --step/--tag opened an entry whose link leads out of the run folder (the newest-complete
    # rule refused it; asking by name did not), so a file outside was read without --follow-links.
    run, outside = tmp_path / "checkpoints", tmp_path / "elsewhere"
    run.mkdir()
    outside.mkdir()
    shutil.copy(LIGHTNING, run / "epoch=0-step=1.ckpt")
    shutil.copy(LIGHTNING, outside / "secret.ckpt")
    os.symlink(outside / "secret.ckpt", run / "epoch=0-step=9.ckpt")
    scene = Scene(run)
    check_refused(
        run_ckptkit("inspect", run, *pick, timeout=TIMEOUT),
        str(run / "epoch=0-step=9.ckpt"),
        "--follow-links",
        scene=scene,
    )
    newest = run_ckptkit("inspect", run, timeout=TIMEOUT)  # passed over, and said
    assert newest.code == 0 and "using epoch=0-step=1.ckpt" in newest.stderr, newest.detail()
    assert "epoch=0-step=9.ckpt is incomplete" in newest.stderr, newest.detail()
    followed = run_ckptkit("inspect", run, *pick, "--follow-links", timeout=TIMEOUT)
    assert followed.code == 0 and "using epoch=0-step=9.ckpt" in followed.stderr, followed.detail()


def test_an_entry_linked_to_the_run_folder_itself_does_not_recurse(tmp_path: Path) -> None:
    # Without this check: checkpoint-7 -> . with a trainer_state.json in the run folder: "internal error:
    # RecursionError" (each entry was read as a run folder again).
    run = _run_folder(tmp_path)
    shutil.copy(TRAINER / "trainer_state.json", run / "trainer_state.json")
    os.symlink(".", run / "checkpoint-7")
    scene = Scene(run)
    newest = run_ckptkit("inspect", run, timeout=TIMEOUT)
    assert newest.code == 0, newest.detail()
    assert "using checkpoint-2" in newest.stderr, newest.detail()
    assert "checkpoint-7 is incomplete: is itself a run folder" in newest.stderr, newest.detail()
    check_refused(
        run_ckptkit("inspect", run, "--step", "7", timeout=TIMEOUT),
        "checkpoint-7",
        "is itself a run folder",
        scene=scene,
    )


def test_thousands_of_links_to_the_run_folder_cost_a_bounded_number_of_listings(tmp_path: Path) -> None:
    # Each checkpoint-N -> . is seen to be a run folder by listing it: 3000 of them listed the
    # 3000-entry run folder 3000 times. Now at most MAX_PROBED entries are listed or opened.
    run = _run_folder(tmp_path, steps=(1,))
    shutil.copy(TRAINER / "trainer_state.json", run / "trainer_state.json")
    for n in range(2, 3002):
        os.symlink(".", run / f"checkpoint-{n}")
    scene = Scene(run)
    refused = run_ckptkit("inspect", run, timeout=TIMEOUT)
    check_refused(refused, str(run), "is itself a run folder", "--step N", scene=scene)
    assert refused.seconds < 10, refused.detail()


def test_entry_names_count_only_ascii_digits_and_are_escaped(tmp_path: Path) -> None:
    # Without this check: `checkpoint-3\n` (the regex's $ matches before a final line break) and `checkpoint-٣`
    # (Arabic-Indic digits) were read as the newest checkpoint-N. A Lightning name with an escape
    # sequence is an entry; it must reach the terminal escaped.
    run = _run_folder(tmp_path)
    _entry(run, 3, "checkpoint-3\n")
    _entry(run, 3, "checkpoint-\u0663")
    newest = run_ckptkit("inspect", run, timeout=TIMEOUT)
    assert newest.code == 0 and "using checkpoint-2 (newest complete of 2 " in newest.stderr, newest.detail()
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    shutil.copy(LIGHTNING, ckpts / "epoch=0-step=1.ckpt")
    (ckpts / "epoch=0-step=5\x1b[2J.ckpt").write_bytes(b"not a checkpoint")
    run2 = run_ckptkit("inspect", ckpts, timeout=TIMEOUT)
    assert run2.code == 0 and "\x1b" not in run2.output and "step=5\\x1b[2J.ckpt is incomplete" in run2.stderr, (
        run2.detail()
    )


def test_fifos_files_and_a_save_in_progress_are_not_checkpoints(tmp_path: Path) -> None:
    # Held (no fix needed): a FIFO named checkpoint-3, a file checkpoint-4, the Trainer's
    # tmp-checkpoint-5 being written, a FIFO trainer_state.json: nothing blocks, checkpoint-2 is read.
    run = _run_folder(tmp_path)
    os.mkfifo(run / "checkpoint-3")
    (run / "checkpoint-4").write_text("not a folder")
    _entry(run, 5, "tmp-checkpoint-5")
    fifo_state = _entry(run, 6) / "trainer_state.json"
    fifo_state.unlink()
    os.mkfifo(fifo_state)
    scene = Scene(run)
    newest = run_ckptkit("inspect", run, timeout=TIMEOUT)
    assert newest.code == 0 and "using checkpoint-2 (newest complete of 3 " in newest.stderr, newest.detail()
    assert "checkpoint-6 is incomplete" in newest.stderr and "FIFO" in newest.stderr, newest.detail()
    check_refused(run_ckptkit("inspect", run, "--step", "6", timeout=TIMEOUT), str(fifo_state), "FIFO", scene=scene)


def test_thousands_of_broken_saves_cost_a_bounded_number_of_opens(tmp_path: Path) -> None:
    # Without this check: every checkpoint-N was opened whole, newest first, until one was complete (300 broken
    # ones: 300 DeepSpeed indexes built). At most MAX_PROBED are opened, and the error says how
    # to reach an older one.
    from ckptkit.formats.run_folder import MAX_PROBED

    run = _run_folder(tmp_path, steps=(1,))
    for n in range(2, 302):
        ckpt = _entry(run, n)
        (ckpt / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    scene = Scene(run)
    refused = run_ckptkit("inspect", run, timeout=TIMEOUT)
    check_refused(refused, str(run), f"the newest {MAX_PROBED} looked into are incomplete", "--step N", scene=scene)
    assert refused.seconds < 10, refused.detail()
    older = run_ckptkit("inspect", run, "--step", "1", timeout=TIMEOUT)
    assert older.code == 0 and "using checkpoint-1 (as asked" in older.stderr, older.detail()


@pytest.mark.parametrize("value", ['"7"', "7.0", "-3", "1e400", "true", "null"])
def test_a_global_step_that_is_not_a_count_is_not_shown_as_one(tmp_path: Path, value: str) -> None:
    # Without this check: a negative global_step (-3) was reported as the run folder's step. A value that is
    # not a non-negative integer is not a step: the entry's name gives it (checkpoint-2).
    from ckptkit.formats.registry import open_checkpoint

    run = _run_folder(tmp_path)
    (run / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": %s}' % value)
    opened = open_checkpoint(str(run))
    assert opened.run.entry == "checkpoint-2" and opened.run.step == 2
    assert opened.index.step == 2  # DeepSpeed's own global_steps, not the trainer state's value


def test_a_trainer_state_that_parses_into_gigabytes_is_refused_within_the_memory_bound(
    tmp_path: Path, monkeypatch
) -> None:
    # Without this check: a 24 MB trainer_state.json of `{},{},...` parsed into about 600 MB (8M dicts) in every
    # command reading the run folder; 60 MB into 1.8 GB. Values are counted on the text first.
    run = _run_folder(tmp_path)
    state = run / "checkpoint-2" / "trainer_state.json"
    state.write_bytes(b'{"global_step": 2, "log_history": [' + b"{}," * (8 << 20) + b"{}]}")
    monkeypatch.setenv("CKPTKIT_MEMORY_BUDGET", str(BUDGET))
    scene = Scene(run)
    bound = rss_bound(BUDGET, state.stat().st_size, with_torch=False)
    check_refused(
        run_ckptkit("inspect", run, "--step", "2", timeout=TIMEOUT), str(state), "values", scene=scene, rss_limit=bound
    )
    newest = run_ckptkit("inspect", run, timeout=TIMEOUT)  # the newest complete one is an older one
    assert newest.code == 0 and "using checkpoint-1" in newest.stderr and "values" in newest.stderr, newest.detail()
    assert newest.peak_rss <= bound, newest.detail()


# ---- consolidate's side files ---------------------------------------------------------------------


def test_a_config_that_parses_into_gigabytes_is_refused_within_the_memory_bound(tmp_path: Path) -> None:
    run = _run_folder(tmp_path, steps=(2,))
    config = run / "checkpoint-2" / "config.json"
    config.unlink()
    config.write_bytes(b'{"x": [' + b"{}," * (5 << 20) + b"{}]}")  # 15 MB, under the 16 MB cap
    out = tmp_path / "out"
    scene = Scene(run, out)
    run_ = run_ckptkit("consolidate", run / "checkpoint-2", out, "--memory-budget", str(BUDGET), timeout=TIMEOUT)
    check_refused(run_, str(config), "values", scene=scene, rss_limit=rss_bound(BUDGET, config.stat().st_size))


def test_a_bad_entry_in_the_run_folder_is_said_not_passed_over(tmp_path: Path) -> None:
    # Without this check: a chat-template folder linked out of the run folder made consolidate skip that whole
    # folder, its config.json with it, and exit 0 saying "no config.json written (none in ...)".
    run = _run_folder(tmp_path, steps=(2,))
    (run / "checkpoint-2" / "config.json").rename(run / "config.json")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.jinja").write_text("{{ secret }}")
    os.symlink(outside, run / "additional_chat_templates")
    out = tmp_path / "out"
    scene = Scene(run, out)
    check_refused(
        run_ckptkit("consolidate", run / "checkpoint-2", out, timeout=TIMEOUT),
        str(run / "additional_chat_templates"),
        "--follow-links",
        scene=scene,
    )


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_config_option_that_is_not_a_folder_or_file_says_what_it_is(tmp_path: Path, kind: str) -> None:
    # Without this check: "--config /dev/null: no such folder" (it exists; it is a device).
    run = _run_folder(tmp_path, steps=(2,))
    config = Path("/dev/null") if kind == "device" else tmp_path / "pipe"
    if kind == "fifo":
        os.mkfifo(config)
    out = tmp_path / "out"
    scene = Scene(run, out)
    check_refused(
        run_ckptkit("consolidate", run / "checkpoint-2", out, "--config", config, timeout=TIMEOUT),
        str(config),
        "character device" if kind == "device" else "FIFO",
        scene=scene,
    )


@pytest.mark.parametrize("where", ["config_dir", "run_folder_config"])
def test_out_that_is_or_holds_a_side_file_is_refused(tmp_path: Path, where: str) -> None:
    # Without this check: `consolidate CKPT DIR --config DIR --overwrite` replaced DIR, config.json and all, and
    # `consolidate output_dir/checkpoint-2 output_dir/config.json --overwrite` replaced the run
    # folder's config.json (the file it had just copied) with a folder.
    run = _run_folder(tmp_path, steps=(2,))
    if where == "config_dir":
        watched = tmp_path / "model"
        watched.mkdir()
        shutil.copy(TRAINER / "config.json", watched / "config.json")
        out, extra = watched, ("--config", str(watched))
    else:
        (run / "checkpoint-2" / "config.json").rename(run / "config.json")
        watched, out, extra = run, run / "config.json", ()
    scene = Scene(watched, out)
    run_ = run_ckptkit("consolidate", run / "checkpoint-2", out, *extra, "--overwrite", timeout=TIMEOUT)
    check_refused(
        run_, str(out), "config.json", "never writes over or into its source", scene=scene, out_may_exist=True
    )
