"""The command line as a new user meets it: names, outputs, --dtype, progress.

Every test runs `python -m ckptkit` in a subprocess whose stderr is not a terminal (a pipe), as
in a CI log, except the pty test, which gives it a terminal to check the tqdm bar."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, ROOT, assert_tensor_equal, load_truth

DCP = DATA / "fsdp2_w2"
ZERO3 = DATA / "deepspeed" / "z3_bf16_w2"
PLAIN = DATA / "plain_state_dict.pt"
DS_CONFIG = DATA / "deepspeed" / "z2_fp32_w2" / "ds_config.json"

SIZE = r"\d+(\.\d+)? [KMGT]?B"
PROGRESS_LINE = re.compile(rf"^.+: {SIZE} of {SIZE}( \(\d+%\))?, ({SIZE}/s|-)$")
DONE_LINE = re.compile(rf"^done in \d+\.\d\d s: {SIZE} at ({SIZE}/s|-)$")


def run(*args: str, interval: float | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env)
    if interval is not None:
        environ["CKPTKIT_PROGRESS_INTERVAL"] = str(interval)
    return subprocess.run(
        [sys.executable, "-m", "ckptkit", *map(str, args)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
    )


def one_error_line(res: subprocess.CompletedProcess) -> str:
    """A refused command: exit 2, nothing on stdout, one line `error: ...` on stderr."""
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def left_in(folder) -> list[str]:
    return sorted(os.listdir(folder))


# ---- progress off a terminal, and the closing line -----------------------------------------------

READING_COMMANDS = {
    "consolidate": lambda t: ["consolidate", DCP, t / "hf"],
    "reshard": lambda t: ["reshard", DCP, t / "r", "--world-size", "3"],
    "convert": lambda t: ["convert", ZERO3, t / "c", "--to", "fsdp2"],
    "verify": lambda t: ["verify", "--deep", DCP],
    "diff": lambda t: ["diff", DCP, DATA / "fsdp2_w3"],
}


@pytest.mark.parametrize("cmd", list(READING_COMMANDS))
def test_plain_progress_lines_and_a_closing_line_with_time_and_rate(cmd, tmp_path):
    """Off a terminal: plain lines (bytes done, total, rate) on stderr, never a bar; the last line
    of stdout gives the elapsed time and the throughput."""
    res = run(*READING_COMMANDS[cmd](tmp_path), "--memory-budget", "1MiB", interval=0)
    assert res.returncode in ((0, 1) if cmd == "diff" else (0,)), res.stderr
    progress = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert progress, f"{cmd} printed no progress line with CKPTKIT_PROGRESS_INTERVAL=0"
    for line in progress:
        assert PROGRESS_LINE.match(line), f"{cmd}: not a progress line: {line!r}"
    assert "\r" not in res.stderr and "%|" not in res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert DONE_LINE.match(last), f"{cmd}: the closing line is {last!r}"


def test_progress_lines_are_spaced_by_the_interval(tmp_path):
    """With the default interval (5 s) a run of a second prints no progress line at all."""
    res = run("reshard", DCP, tmp_path / "r", "--world-size", "3")
    assert res.returncode == 0 and res.stderr == ""
    assert DONE_LINE.match(res.stdout.strip().splitlines()[-1])


def test_progress_line_reports_bytes_total_and_rate(tmp_path):
    res = run("consolidate", DCP, tmp_path / "hf", "--memory-budget", "1MiB", interval=0)
    last = res.stderr.strip().splitlines()[-1]
    # the last advance completes the total the command declared
    done, total = re.match(rf"^consolidate: ({SIZE}) of ({SIZE})", last).group(1, 3)
    assert done == total, last


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_before_or_after_the_command(where, tmp_path):
    args = ["verify", "--deep", DCP]
    argv = ["-q", *args] if where == "before" else [args[0], "-q", *args[1:]]
    res = run(*argv, interval=0)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == ""
    res = run("consolidate", DCP, tmp_path / "hf", "--quiet", interval=0)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == ""
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_quiet_after_the_command_still_prints_errors(tmp_path):
    res = run("verify", "-q", tmp_path / "missing")
    assert res.returncode == 1 and "no such file or folder" in res.stderr


def test_a_terminal_gets_a_tqdm_bar(tmp_path):
    """On a terminal (a pty) the progress is tqdm's bar on stderr, not plain lines."""
    import pty  # noqa: F401  (POSIX only; os.openpty below)

    import fcntl
    import struct
    import termios

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # a terminal has a size
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", COLUMNS="100")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkit", "consolidate", str(DCP), str(tmp_path / "hf"), "--memory-budget", "1MiB"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=follower,
    )
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed its end (EIO on Linux)
            break
        if not chunk:
            break
        seen += chunk
    out, _ = proc.communicate(timeout=60)
    os.close(leader)
    assert proc.returncode == 0, seen
    text = seen.decode(errors="replace")
    assert "consolidate" in text and "%|" in text, f"no tqdm bar on the terminal: {text!r}"
    assert not any(PROGRESS_LINE.match(ln) for ln in text.replace("\r", "\n").splitlines())  # no plain lines
    assert DONE_LINE.match(out.decode().strip().splitlines()[-1])


# ---- --from and --to: one table of names --------------------------------------------------------


def test_from_and_to_take_the_same_names():
    from ckptkit.convert import SOURCES, TARGETS

    assert SOURCES == TARGETS
    for name in ("dcp", "fsdp", "fsdp2", "deepspeed", "zero1", "zero2", "zero3", "torch", "safetensors", "hf"):
        assert name in TARGETS


@pytest.mark.parametrize("name", ["fsdp", "fsdp2", "dcp"])
def test_to_fsdp_aliases_write_dcp_in_the_fsdp2_layout(name, tmp_path):
    res = run("convert", ZERO3, tmp_path / name, "--to", name, "--world-size", "3", "--from", "zero3")
    assert res.returncode == 0, res.stderr
    assert "converted deepspeed -> dcp for 3 rank(s)" in res.stdout
    info = json.loads(run("inspect", "--json", tmp_path / name).stdout)
    assert info["format"] == "dcp" and info["world_size"] == 3
    # every alias writes the same checkpoint, and --from takes the alias back
    if name != "dcp":
        assert run("convert", ZERO3, tmp_path / "ref", "--to", "dcp", "--world-size", "3").returncode == 0
        res = run("diff", tmp_path / "ref", tmp_path / name)
        assert res.returncode == 0, res.stdout
    assert run("convert", tmp_path / name, tmp_path / "again", "--to", "torch", "--from", name).returncode == 0


def test_to_hf_is_a_safetensors_folder_and_from_hf_reads_it(tmp_path):
    res = run("convert", DCP, tmp_path / "hf", "--to", "hf")
    assert res.returncode == 0, res.stderr
    assert "converted dcp -> safetensors" in res.stdout
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    res = run("convert", tmp_path / "hf", tmp_path / "t.pt", "--to", "torch", "--from", "hf")
    assert res.returncode == 0, res.stderr


def test_from_zero_stage_is_checked_against_the_recorded_stage(tmp_path):
    assert run("convert", ZERO3, tmp_path / "a", "--to", "torch", "--from", "zero3").returncode == 0
    assert run("convert", ZERO3, tmp_path / "b", "--to", "torch", "--from", "deepspeed").returncode == 0
    line = one_error_line(run("convert", ZERO3, tmp_path / "c", "--to", "torch", "--from", "zero2"))
    assert "stage 3" in line and "zero2" in line
    line = one_error_line(run("convert", ZERO3, tmp_path / "d", "--to", "torch", "--from", "fsdp"))
    assert "deepspeed checkpoint, not fsdp" in line
    assert left_in(tmp_path) == ["a", "b"]


def test_to_deepspeed_keeps_the_stage_of_the_source_config(tmp_path):
    res = run("convert", ZERO3, tmp_path / "ds", "--to", "deepspeed", "--world-size", "3")
    assert res.returncode == 0, res.stderr
    assert "-> zero3 for 3 rank(s)" in res.stdout
    info = json.loads(run("inspect", "--json", tmp_path / "ds").stdout)
    assert info["metadata"]["deepspeed"]["stage"] == 3 and info["world_size"] == 3


# ---- reshard --world-size -----------------------------------------------------------------------


def test_reshard_world_size_and_its_short_form(tmp_path):
    a = run("reshard", DCP, tmp_path / "a", "--world-size", "3")
    b = run("reshard", DCP, tmp_path / "b", "--to", "3")
    c = run("reshard", DCP, tmp_path / "c", "--to", "3", "--world-size", "3")
    for res in (a, b, c):
        assert res.returncode == 0 and "from 2 to 3 rank(s)" in res.stdout, res.stderr
    assert run("diff", tmp_path / "a", tmp_path / "b").returncode == 0


def test_reshard_world_size_disagreeing_or_missing_is_one_sentence(tmp_path):
    line = one_error_line(run("reshard", DCP, tmp_path / "x", "--to", "3", "--world-size", "4"))
    assert "--world-size 4 and --to 3 disagree" in line
    line = one_error_line(run("reshard", DCP, tmp_path / "y"))
    assert "--world-size" in line
    assert left_in(tmp_path) == []


# ---- --dtype takes torch's spellings ------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling,dtype",
    [
        ("torch.bfloat16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("torch.float16", torch.float16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("torch.float32", torch.float32),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("float", torch.float32),
    ],
)
def test_dtype_spellings(spelling, dtype, tmp_path):
    res = run("consolidate", ZERO3, tmp_path / "m.safetensors", "--dtype", spelling)
    assert res.returncode == 0, res.stderr
    out = load_file(tmp_path / "m.safetensors")
    assert out["embed.weight"].dtype == dtype
    truth = load_truth("deepspeed/z3_bf16_w2")
    key = next(k for k in truth if k.endswith("embed.weight") and "optim" not in k and truth[k].dtype == torch.float32)
    assert_tensor_equal(out["embed.weight"], truth[key].to(dtype), "embed.weight")


def test_dtype_that_is_not_floating_is_refused(tmp_path):
    line = one_error_line(run("consolidate", DCP, tmp_path / "o", "--dtype", "torch.int8"))
    assert "not a floating dtype" in line


# ---- outputs go where the user named them -------------------------------------------------------


@pytest.mark.parametrize("name", ["model.pt", "model.bin"])
def test_to_torch_with_a_file_name_writes_that_file(name, tmp_path):
    res = run("convert", DCP, tmp_path / name, "--to", "torch")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / name).is_file()
    assert left_in(tmp_path) == [name]  # no temporary, no lock left beside it
    state = torch.load(tmp_path / name, weights_only=True)
    truth = load_truth("fsdp2_w2")
    for key, value in truth.items():
        if key.startswith("model."):
            assert_tensor_equal(state["model"][key[len("model.") :]], value, key)
    # the folder form is unchanged: OUT/checkpoint.pt, the same content
    assert run("convert", DCP, tmp_path / "folder", "--to", "torch").returncode == 0
    folder = torch.load(tmp_path / "folder" / "checkpoint.pt", weights_only=True)
    assert folder["model"].keys() == state["model"].keys()


def test_a_file_output_is_refused_when_it_exists_and_replaced_with_overwrite(tmp_path):
    target = tmp_path / "model.pt"
    target.write_bytes(b"old")
    line = one_error_line(run("convert", DCP, target, "--to", "torch"))
    assert "already exists" in line and target.read_bytes() == b"old"
    assert run("convert", DCP, target, "--to", "torch", "--overwrite").returncode == 0
    assert "model" in torch.load(target, weights_only=True)
    assert left_in(tmp_path) == ["model.pt"]


@pytest.mark.parametrize("command", ["consolidate", "convert-safetensors", "convert-hf"])
def test_a_safetensors_file_name_writes_that_file(command, tmp_path):
    out = tmp_path / "model.safetensors"
    extra = {"consolidate": [], "convert-safetensors": ["--to", "safetensors"], "convert-hf": ["--to", "hf"]}[command]
    res = run(command.split("-")[0], DCP, out, *extra)
    assert res.returncode == 0, res.stderr
    assert out.is_file() and left_in(tmp_path) == ["model.safetensors"]
    loaded = load_file(out)
    truth = load_truth("fsdp2_w2")
    for name, value in loaded.items():
        assert_tensor_equal(value, truth["model." + name], name)
    assert len(loaded) >= 12


def test_a_safetensors_file_that_would_need_shards_is_refused(tmp_path):
    line = one_error_line(run("consolidate", DCP, tmp_path / "m.safetensors", "--max-shard-size", "1KB"))
    assert "give a folder" in line
    line = one_error_line(run("consolidate", DCP, tmp_path / "m.safetensors", "--include-optimizer"))
    assert "must be a folder" in line
    assert left_in(tmp_path) == []


def test_safetensors_summary_names_what_was_not_written(tmp_path):
    res = run("convert", DCP, tmp_path / "st", "--to", "safetensors")
    assert res.returncode == 0, res.stderr
    summary = res.stdout.splitlines()[0]
    written, _, dropped = summary.partition("not written:")
    assert "state tensors" not in written and "param groups" not in written, summary
    assert "optimizer state (18 state tensors" in dropped and "weights only" in dropped, summary


# ---- an option that does not apply to the target is refused ------------------------------------


@pytest.mark.parametrize(
    "args,says",
    [
        (["--to", "torch", "--world-size", "8"], "--world-size does not apply to --to torch"),
        (["--to", "safetensors", "--world-size", "2"], "--world-size does not apply to --to safetensors"),
        (["--to", "dcp", "--ds-config", str(DS_CONFIG)], "--ds-config applies only to DeepSpeed targets"),
        (["--to", "hf", "--frozen", "pos"], "--frozen does not apply to --to hf"),
    ],
)
def test_inapplicable_options_are_refused_in_one_sentence(args, says, tmp_path):
    line = one_error_line(run("convert", DCP, tmp_path / "out", *args))
    assert says in line
    assert left_in(tmp_path) == []


# ---- a single-file output keeps the guarantees of a folder -------------------------------------


def test_a_file_output_never_replaces_its_own_source(tmp_path):
    src = tmp_path / "state.pt"
    src.write_bytes(PLAIN.read_bytes())
    line = one_error_line(run("convert", src, src, "--to", "torch", "--overwrite"))
    assert "state.pt" in line
    assert src.read_bytes() == PLAIN.read_bytes() and left_in(tmp_path) == ["state.pt"]


def test_a_failed_file_output_leaves_nothing(tmp_path):
    from ckptkit.storage.output import open_output

    with pytest.raises(RuntimeError):
        with open_output(str(tmp_path / "model.pt"), single_file=True) as out:
            with out.open(out.name) as f:
                f.write(b"half")
            raise RuntimeError("the writer failed")
    assert left_in(tmp_path) == []
    with open_output(str(tmp_path / "model.pt"), single_file=True) as out:
        with out.open(out.name) as f:
            f.write(b"whole")
    assert left_in(tmp_path) == ["model.pt"] and (tmp_path / "model.pt").read_bytes() == b"whole"
