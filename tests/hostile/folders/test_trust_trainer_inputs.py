"""Red team for issue 13's new inputs: run folders, consolidate's side files, trainer_state.json and
the DeepSpeed reader of any optimizer.

Each case is crafted from the real fixtures the way an attacker or a careless user would break
them (an entry linked out of the run folder, a link from an entry back to the run folder, a
config that parses into far more memory than it takes, an OUT that is a file the command copies,
optimizer state keys that collide, a value copied to every parameter...), run through the CLI in
a subprocess (tests/hostile.py) and held to the contract of docs/reliability.md. Each test says
what it found on the code before its fix.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers.hostile import Scene, check_refused, rss_bound, run_ckptkit

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fixtures" / "data"
TRAINER = DATA / "trainer" / "ds_z2" / "checkpoint-2"
LIGHTNING = DATA / "lightning" / "single_w1.ckpt"
DS_OPTIM = DATA / "deepspeed_optimizers" / "z2_clientadamw_bf16_w2"
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
    # Found: --step/--tag opened an entry whose link leads out of the run folder (the newest-complete
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
    # Found: checkpoint-7 -> . with a trainer_state.json in the run folder: "internal error:
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
    # Found: `checkpoint-3\n` (the regex's $ matches before a final line break) and `checkpoint-٣`
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
    # Found: every checkpoint-N was opened whole, newest first, until one was complete (300 broken
    # ones: 300 DeepSpeed indexes built). Now at most MAX_PROBED are opened, and the error says how
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
    # Found: a negative global_step (-3) was reported as the run folder's step. Now a value that is
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
    # Found: a 24 MB trainer_state.json of `{},{},...` parsed into about 600 MB (8M dicts) in every
    # command reading the run folder; 60 MB into 1.8 GB. Values are now counted on the text first.
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
    # Found: a chat-template folder linked out of the run folder made consolidate skip that whole
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
    # Found: "--config /dev/null: no such folder" (it exists; it is a device).
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
    # Found: `consolidate CKPT DIR --config DIR --overwrite` replaced DIR, config.json and all, and
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


# ---- DeepSpeed: any optimizer's state ---------------------------------------------------------------


def _ds_with_state(tmp_path: Path, change) -> Path:
    """The real ZeRO-2 (client AdamW) fixture with each rank's group-0 state changed by `change`."""
    ckpt = tmp_path / "ds"
    shutil.copytree(DS_OPTIM, ckpt)
    for rank, path in enumerate(sorted(glob.glob(str(ckpt / "global_step2" / "*optim_states.pt")))):
        saved = torch.load(path, weights_only=False)  # trusted: the project's own fixture
        change(rank, saved["optimizer_state_dict"]["base_optimizer_state"]["state"][0])
        torch.save(saved, path)
    return ckpt


@pytest.mark.parametrize("cmd", ["inspect", "reshard"])
def test_state_keys_that_name_the_same_entry_are_refused(tmp_path: Path, cmd: str) -> None:
    # Found: keys 1 and "1" both became optim.state.<p>.1: reshard wrote 2.0 under both (1.0 lost), exit 0.
    def change(rank, state):
        state[1], state["1"] = torch.tensor(1.0), torch.tensor(2.0)

    ckpt = _ds_with_state(tmp_path, change)
    out = tmp_path / "out"
    scene = Scene(ckpt, out)
    args = ["inspect", ckpt] if cmd == "inspect" else ["reshard", ckpt, out, "--to", "3"]
    check_refused(run_ckptkit(*args, timeout=TIMEOUT), "zero_pp_rank_0", "name the same state", scene=scene)


def test_a_large_value_kept_for_every_parameter_is_refused_quickly(tmp_path: Path) -> None:
    # Found: a 2M-element list in one group's state (not partitioned, so kept for each of its 5
    # parameters) kept `inspect` walking 10M values for minutes (timed out at 30 s); convert took
    # 16 s, reshard 28 s.
    ckpt = _ds_with_state(tmp_path, lambda rank, state: state.__setitem__("history", list(range(300_000))))
    scene = Scene(ckpt)
    run = run_ckptkit("inspect", ckpt, timeout=TIMEOUT)
    check_refused(run, "zero_pp_rank_0", "'history'", "too large to keep for each", scene=scene)
    assert run.seconds < 15, run.detail()


def test_a_large_tensor_kept_whole_is_refused_within_the_memory_budget(tmp_path: Path) -> None:
    ckpt = _ds_with_state(tmp_path, lambda rank, state: state.__setitem__("big", torch.ones(3 << 20)))
    out = tmp_path / "out"
    scene = Scene(ckpt, out)
    budget = 32 << 20
    size = max(os.path.getsize(p) for p in glob.glob(str(ckpt / "global_step2" / "*optim_states.pt")))
    run = run_ckptkit("reshard", ckpt, out, "--to", "3", "--memory-budget", str(budget), timeout=TIMEOUT)
    check_refused(run, "optim_states.pt", "memory budget", scene=scene, rss_limit=rss_bound(budget, size))


def test_non_string_keys_and_integer_partitioned_state_survive_a_reshard(tmp_path: Path) -> None:
    # Kept, not refused: an int key (7) keeps its type, and an int64 state with the partition's
    # length is cut like the masters, bit for bit.
    def change(rank, state):
        state[7] = torch.tensor(7.0)
        state["counts"] = torch.arange(len(state["exp_avg"]), dtype=torch.int64) + 1000 * rank

    ckpt = _ds_with_state(tmp_path, change)
    before = torch.cat(
        [
            torch.load(p, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["counts"]
            for p in sorted(glob.glob(str(ckpt / "global_step2" / "*optim_states.pt")))
        ]
    )
    out = tmp_path / "out"
    run = run_ckptkit("reshard", ckpt, out, "--to", "3", timeout=TIMEOUT)
    assert run.code == 0, run.detail()
    states = [
        torch.load(p, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        for p in sorted(glob.glob(str(out / "global_step2" / "*optim_states.pt")))
    ]
    assert len(states) == 3 and all(7 in s and float(s[7]) == 7.0 for s in states)
    model_states = torch.load(ckpt / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    total = sum(shape.numel() for shape in model_states["param_shapes"][0].values())  # without the padding
    after = torch.cat([s["counts"] for s in states])
    assert after.dtype == torch.int64
    assert torch.equal(after[:total], before[:total]), "int64 state changed by the reshard"
