"""Run folders: pointed at a training output folder, the read-only commands read its newest COMPLETE
checkpoint and say which one; --step/--tag pick another; an unrecognised folder's error lists what
it found and what would be recognised.

The folders are composed from real checkpoints (the HF Trainer fixtures, DeepSpeed and DCP
fixtures, a Checkpointer run) copied into the layouts the trainers write, then one is damaged the
way a killed save leaves it (a rank file missing, trainer_state.json not yet written)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptkit.formats.registry import open_checkpoint
from ckptkit_cli.main import cli
from conftest import DATA, assert_tensor_equal

TRAINER = DATA / "trainer"
DS = DATA / "deepspeed" / "z2_fp32_w2"


def run(*args):
    """(exit code, stdout, stderr) of `ckptkit ARGS` in process."""
    res = CliRunner().invoke(cli, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


def _output_dir(tmp_path, fixture="ds_z2", steps=(1, 2, 3)):
    """An HF output_dir holding checkpoint-N/ copies of a real Trainer checkpoint, trainer_state.json's
    global_step set to N as the Trainer writes it."""
    out = tmp_path / "output_dir"
    for n in steps:
        ckpt = out / f"checkpoint-{n}"
        shutil.copytree(TRAINER / fixture / "checkpoint-2", ckpt)
        state = json.loads((ckpt / "trainer_state.json").read_text())
        state["global_step"] = n
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return out


def test_output_dir_reads_the_newest_complete_checkpoint_and_says_so(tmp_path):
    out = _output_dir(tmp_path)
    (out / "checkpoint-3" / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    code, stdout, stderr = run("inspect", out)
    assert code == 0, stderr
    assert stderr.startswith(
        f"{out}: using checkpoint-2 (newest complete of 3 in this HF Trainer output folder; "
        f"checkpoint-3 is incomplete: "
    )
    assert (
        "global_step2/mp_rank_00_model_states.pt: says dp_world_size 2, but the optim-states file of rank 1 "
        "is missing (bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt)"
    ) in stderr
    assert len(stderr.strip().splitlines()) == 1
    lines = stdout.splitlines()
    assert lines[1].startswith("chosen      checkpoint-2 (newest complete of 3")
    assert "step        2" in lines  # trainer_state.json's global_step of checkpoint-2
    doc = json.loads(run("inspect", "--json", out)[1])
    assert doc["summary"]["step"] == 2 and doc["summary"]["run_folder"]["chosen"] == "checkpoint-2"
    assert [s["entry"] for s in doc["summary"]["run_folder"]["skipped"]] == ["checkpoint-3"]
    # the other read-only commands read the same one
    code, stdout, stderr = run("verify", out)
    assert code == 0 and "using checkpoint-2" in stderr, stdout + stderr
    code, stdout, stderr = run("diff", out, out / "checkpoint-2")
    assert code == 0, stdout + stderr
    # the library too
    opened = open_checkpoint(str(out))
    assert opened.run.entry == "checkpoint-2" and opened.path == f"{out}/checkpoint-2"


def test_a_checkpoint_without_trainer_state_is_incomplete(tmp_path):
    out = _output_dir(tmp_path, "fsdp2")
    (out / "checkpoint-3" / "trainer_state.json").unlink()
    code, stdout, stderr = run("inspect", out)
    assert code == 0
    assert (
        "using checkpoint-2 (newest complete of 3 in this HF Trainer output folder; checkpoint-3 is "
        "incomplete: no trainer_state.json (the Trainer writes it last))"
    ) in stderr
    # a rank file missing in accelerate's optimizer_0/ DCP folder
    shutil.rmtree(out / "checkpoint-3")
    (out / "checkpoint-2" / "optimizer_0" / "__1_0.distcp").unlink()
    code, stdout, stderr = run("verify", out)
    assert code == 0, stdout + stderr
    assert "using checkpoint-1 (newest complete of 2" in stderr and "checkpoint-2 is incomplete: " in stderr
    assert "__1_0.distcp" in stderr


def test_step_and_tag_pick_another_checkpoint(tmp_path):
    out = _output_dir(tmp_path)
    (out / "checkpoint-3" / "global_step2" / "mp_rank_00_model_states.pt").unlink()
    code, stdout, stderr = run("inspect", out, "--step", "1")
    assert code == 0 and "step        1" in stdout.splitlines()
    assert stderr.strip() == f"{out}: using checkpoint-1 (as asked; 3 checkpoint(s) in this HF Trainer output folder)"
    code, stdout, stderr = run("inspect", out, "--tag", "checkpoint-1")
    assert code == 0 and "step        1" in stdout.splitlines()
    # asked for, the damaged one is read, and its damage reported
    code, stdout, stderr = run("verify", out, "--step", "3")
    assert code != 0 and "no *_model_states.pt file in the DeepSpeed tag folder" in stdout + stderr
    code, stdout, stderr = run("inspect", out, "--step", "7")
    assert code == 2
    assert stderr.strip() == f"error: {out}: no checkpoint of step 7 in this HF Trainer output folder (steps: 1, 2, 3)"
    code, stdout, stderr = run("inspect", out, "--tag", "checkpoint-9")
    assert code == 2 and "it holds checkpoint-3, checkpoint-2, checkpoint-1" in stderr
    code, stdout, stderr = run("inspect", out, "--tag", "checkpoint-1", "--step", "1")
    assert code == 2 and "give one of them" in stderr
    code, stdout, stderr = run("inspect", DATA / "fsdp2_w2", "--step", "1")
    assert code == 2 and "--step picks a checkpoint in a run folder" in stderr


def test_consolidate_a_run_folder_takes_its_side_files(tmp_path):
    out = _output_dir(tmp_path, steps=(1, 2))
    (out / "checkpoint-2" / "trainer_state.json").unlink()  # a save killed before its end
    (out / "tokenizer.json").write_text('{"from": "output_dir"}')
    target = tmp_path / "hf"
    code, stdout, stderr = run("consolidate", out, target)
    assert code == 0, stdout + stderr
    assert "using checkpoint-1" in stderr
    assert f"copied from {out}/checkpoint-1: config.json, generation_config.json" in stdout
    assert f"copied from {out}: tokenizer.json" in stdout
    assert (target / "config.json").read_bytes() == (out / "checkpoint-1" / "config.json").read_bytes()
    code, stdout, stderr = run("diff", "--model-only", target, out / "checkpoint-1")
    assert code == 0, stdout + stderr


def test_deepspeed_save_folder_without_latest(tmp_path):
    folder = tmp_path / "ds_save"
    for n in (2, 4, 6):
        shutil.copytree(DS / "global_step2", folder / f"global_step{n}")
    (folder / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    code, stdout, stderr = run("inspect", folder)
    assert code == 0, stderr
    assert stderr.startswith(
        f"{folder}: using global_step4 (newest complete of 3 in this DeepSpeed save folder; "
        f"global_step6 is incomplete: "
    )
    target = tmp_path / "model"
    code, stdout, stderr = run("consolidate", folder, target)
    assert code == 0, stdout + stderr
    code, stdout, stderr = run("diff", "--model-only", target, DS)
    assert code == 0, stdout + stderr
    # --tag keeps its DeepSpeed meaning; --step N is tag global_stepN
    assert run("inspect", folder, "--tag", "global_step2")[0] == 0
    code, stdout, stderr = run("verify", folder, "--step", "6")
    assert code != 0 and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in stdout + stderr
    # a DeepSpeed save with `latest`: --step picks a tag of it
    shutil.copytree(DS, tmp_path / "with_latest")
    assert run("inspect", tmp_path / "with_latest", "--step", "2")[0] == 0


def test_checkpointer_directory(tmp_path):
    import ckptkit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters())
    ck = ckptkit.Checkpointer(str(tmp_path / "run"), keep=5, rng=False)
    weights = {}
    for step in (1, 2, 3):
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        ck.save(step, model, optim)
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    (tmp_path / "run" / "step_000000003" / ".metadata").unlink()  # its marker lists it
    code, stdout, stderr = run("consolidate", tmp_path / "run", tmp_path / "out")
    assert code == 0, stdout + stderr
    assert (
        "using step_000000002 (newest complete of 3 in this Checkpointer directory; step_000000003 is "
        "incomplete: lacks .metadata, which its .ckptkit-complete lists)"
    ) in stderr
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in weights[2].items():
        assert_tensor_equal(loaded[name], value, name)
    # inspect still lists the steps; --step inspects one
    code, stdout, _ = run("inspect", tmp_path / "run")
    assert code == 0 and stdout.startswith("checkpointer  ")
    code, stdout, _ = run("inspect", tmp_path / "run", "--step", "1")
    assert code == 0 and "chosen      step_000000001 (as asked" in stdout and "format      dcp" in stdout


def test_lightning_checkpoints_folder(tmp_path):
    """Lightning's checkpoints/: torch.save files (and a sharded checkpoint folder) named
    epoch=E-step=S.ckpt; newest by the step in the name, or by modification time with last.ckpt."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for n in (5, 10):
        shutil.copy(DATA / "plain_state_dict.pt", folder / f"epoch={n // 5 - 1}-step={n}.ckpt")
    shutil.copytree(DATA / "fsdp2_w2", folder / "epoch=2-step=15.ckpt")  # sharded: a DCP folder
    (folder / "epoch=2-step=15.ckpt" / "__1_0.distcp").unlink()
    code, stdout, stderr = run("inspect", folder)
    assert code == 0, stderr
    assert stderr.startswith(
        f"{folder}: using epoch=1-step=10.ckpt (newest complete of 3 in this Lightning "
        f"checkpoints folder; epoch=2-step=15.ckpt is incomplete: "
    )
    code, stdout, stderr = run("inspect", folder, "--step", "5")
    assert code == 0 and "using epoch=0-step=5.ckpt (as asked" in stderr
    shutil.copy(DATA / "plain_state_dict.pt", folder / "last.ckpt")
    for i, name in enumerate(("epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt", "epoch=2-step=15.ckpt", "last.ckpt")):
        os.utime(folder / name, (1_000_000 + i, 1_000_000 + i))
    code, stdout, stderr = run("inspect", folder)
    assert code == 0 and stderr.startswith(
        f"{folder}: using last.ckpt (newest complete of 4 in this Lightning checkpoints folder by modification time"
    )


def test_none_complete_and_unrecognised_folders_are_one_sentence(tmp_path):
    out = _output_dir(tmp_path, steps=(1, 2))
    for n in (1, 2):
        (out / f"checkpoint-{n}" / "trainer_state.json").unlink()
    code, stdout, stderr = run("verify", out)
    assert code == 2 or code == 1
    assert (
        f"{out}: a HF Trainer output folder with 2 checkpoint(s), none complete (checkpoint-2: no "
        f"trainer_state.json (the Trainer writes it last); checkpoint-1: no trainer_state.json"
    ) in stdout + stderr
    junk = tmp_path / "junk"
    (junk / "logs").mkdir(parents=True)
    (junk / "notes.txt").write_text("x")
    code, stdout, stderr = run("inspect", junk)
    assert code == 2
    assert stderr.strip().startswith(
        f"error: {junk}: not a checkpoint ckptkit recognises; found 2 entries "
        f"(logs/, notes.txt). Recognised: a DCP checkpoint (.metadata)"
    )
    assert "checkpoint-N/ (HF Trainer output_dir), step_N/ (ckptkit Checkpointer)" in stderr
    assert len(stderr.strip().splitlines()) == 1
    for name in ("a.pt", "b.pt"):
        shutil.copy(DATA / "plain_state_dict.pt", junk / name)
    code, stdout, stderr = run("inspect", junk)
    assert code == 2 and "found 2 torch.save files (a.pt, b.pt): name the one to read" in stderr


def test_quiet_says_nothing_about_the_choice(tmp_path):
    out = _output_dir(tmp_path, steps=(1,))
    code, stdout, stderr = run("-q", "verify", out)
    assert code == 0 and stdout == "" and stderr == ""
