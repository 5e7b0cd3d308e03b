"""What the command line prints cannot be forged, and Ctrl-C always ends a command cleanly.

Injection: a real DCP checkpoint (torch's dcp.save) whose tensor names and string values carry
newlines, carriage returns, terminal escape sequences (OSC retitle, clear screen, colour) and a
bidi override. Every command's human output escapes them (no raw control character reaches the
terminal, no forged line appears) and --json keeps the original strings in valid JSON.

Ctrl-C: SIGINT at many points of real convert / reshard / consolidate runs (threads copying,
kernel copies, commit), twice in a row, and to the --nproc launcher: always "interrupted" on the
last stderr line, exit 130, no traceback, no "internal error", nothing left next to OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import unicodedata
from pathlib import Path

import pytest
import torch

from helpers import hostile
from conftest import save_random_dcp

# each is a hostile piece of a name: a line break, a carriage return, an OSC sequence that retitles
# the terminal, a CSI sequence that clears it, a bidi override that reverses what follows
NASTY = {"nl": "a\nb", "cr": "c\rd", "osc": "t\x1b]0;x\x07itle", "csi": "clear\x1b[2J", "bidi": "bi\u202eevil"}
ESCAPED = {"nl": "a\\nb", "cr": "c\\rd", "osc": "t\\x1b]0;x\\x07itle", "csi": "clear\\x1b[2J", "bidi": "bi\\u202eevil"}
FORGED = "/forged/path: ok"  # what a newline inside a value tries to print as a line of its own
NOTE = f"hello\n{FORGED}\x1b[31mred\u202e\rX"
SKIPPED = f"extra\n{FORGED}\x1b]0;pwned\x07"  # a top-level tensor consolidate lists as not written


def _save(path: Path, bump: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(0)
    model = {f"layer.{v}.weight": torch.randn(8, 4, generator=gen) for v in NASTY.values()}
    model[f"w\nok: {path} (dcp, 1 tensors"] = torch.zeros(3)  # tries to forge verify's ok line
    if bump:
        model[f"layer.{NASTY['nl']}.weight"] += 1
    dcp.save({"model": model, SKIPPED: torch.ones(2), "note": NOTE, "step": 7}, checkpoint_id=str(path), no_dist=True)


@pytest.fixture(scope="module")
def nasty(tmp_path_factory):
    root = tmp_path_factory.mktemp("nasty")
    a, b, cut = root / "a", root / "b", root / "cut"
    _save(a)
    _save(b, bump=True)
    shutil.copytree(a, cut)
    data = next(cut.glob("*.distcp"))
    os.truncate(data, data.stat().st_size // 3)  # items of the nasty tensors now lie past the end
    return a, b, cut


def _unsafe(text: str) -> list[str]:
    """Characters a terminal would act on or hide: every control and format character but the
    newline that ends a line."""
    return sorted(
        {repr(ch) for ch in text if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp")}
    )


def _assert_safe(run: hostile.Run, forbidden_lines: tuple[str, ...] = (FORGED,)) -> None:
    detail = run.detail()
    assert not run.timed_out, detail
    assert "Traceback" not in run.output and "internal error" not in run.output, detail
    for name, stream in (("stdout", run.stdout), ("stderr", run.stderr)):
        assert not _unsafe(stream), f"raw control characters on {name}: {_unsafe(stream)}\n{detail}"
        for line in stream.splitlines():
            assert not line.startswith(forbidden_lines), f"forged line {line!r} on {name}\n{detail}"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_inspect_escapes_names_and_values_and_json_keeps_them(nasty):
    a, _, _ = nasty
    run = hostile.run_ckptkit("inspect", a)
    _assert_safe(run)
    assert run.code == 0, run.detail()
    for key in ESCAPED:
        assert ESCAPED[key] in run.stdout, f"{key} not shown escaped\n{run.detail()}"
    assert "hello\\n/forged/path: ok\\x1b[31mred\\u202e\\rX" in run.stdout, run.detail()
    assert not any(line.startswith("ok: ") for line in run.stdout.splitlines())

    doc = json.loads(hostile.run_ckptkit("inspect", "--json", a).stdout)  # valid JSON, strings as saved
    keys = {t["key"] for t in doc["tensors"]}
    assert {f"model.layer.{v}.weight" for v in NASTY.values()} <= keys
    assert {o["key"]: o["value"] for o in doc["objects"]}["note"] == NOTE


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("deep", [False, True], ids=["verify", "verify-deep"])
def test_verify_says_ok_once_and_lists_problems_escaped(nasty, deep):
    a, _, cut = nasty
    flag = ["--deep"] if deep else []
    run = hostile.run_ckptkit("verify", *flag, a)
    _assert_safe(run)
    assert run.code == 0 and run.stdout.count("ok: ") == 1 and run.stdout.startswith(f"ok: {a} ("), run.detail()

    run = hostile.run_ckptkit("verify", *flag, cut)
    _assert_safe(run, (FORGED, "ok:", "b.weight"))
    assert run.code == 1, run.detail()
    problems = [ln for ln in run.stderr.splitlines() if ln.startswith("  - ")]
    assert len(problems) == int(run.stderr.split(" problem(s)")[0].rsplit(" ", 1)[1]), run.detail()
    assert any(v in p for p in problems for v in ESCAPED.values()), run.detail()  # names the tensor, escaped


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_diff_escapes_names_and_json_keeps_them(nasty):
    a, b, _ = nasty
    run = hostile.run_ckptkit("diff", a, b)
    _assert_safe(run, (FORGED, "b.weight"))
    assert run.code == 1 and f"different layer.{ESCAPED['nl']}.weight" in run.stdout, run.detail()
    doc = json.loads(hostile.run_ckptkit("diff", "--json", a, b).stdout)
    assert [r["name"] for r in doc["rows"] if r["status"] == "different"] == [f"layer.{NASTY['nl']}.weight"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op", ["consolidate", "convert", "reshard"])
def test_writing_commands_summaries_are_escaped(nasty, tmp_path, op):
    a, _, _ = nasty
    out = tmp_path / "out"
    extra = {"convert": ["--to", "torch"], "reshard": ["--to", "2"]}.get(op, [])
    run = hostile.run_ckptkit(op, a, out, *extra)
    _assert_safe(run)
    assert run.code == 0 and out.is_dir(), run.detail()
    if op == "consolidate":  # the top-level tensor is listed as not written, escaped
        assert "extra\\n/forged/path: ok\\x1b]0;pwned\\x07" in run.stdout, run.detail()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_error_sentences_and_tracebacks_are_escaped(nasty, tmp_path, debug):
    _, _, cut = nasty
    out = tmp_path / "out"
    scene = hostile.Scene(cut, out)
    run = hostile.run_ckptkit(*(["--debug"] if debug else []), "consolidate", cut, out)
    assert not _unsafe(run.output), run.detail()
    assert any(v in run.stderr for v in ESCAPED.values()), run.detail()  # names the tensor, escaped
    if debug:  # the traceback is shown (asked for), escaped like everything else
        assert run.code == 2 and "Traceback" in run.stderr, run.detail()
        assert scene.source_unchanged() and not scene.new_in_parent()
        return
    hostile.check_refused(run, str(next(cut.glob("*.distcp"))), scene=scene)


def test_click_usage_errors_are_escaped(nasty, tmp_path):
    a, _, _ = nasty
    run = hostile.run_ckptkit("convert", a, tmp_path / "out", "--to", "x\x1b]0;pwned\x07\nok: fine")
    assert run.code == 2 and "Error: " in run.stderr and "x\\x1b]0;pwned\\x07\\nok: fine" in run.stderr, run.detail()
    assert not _unsafe(run.output) and "\nok: fine" not in run.output, run.detail()


# ---- Ctrl-C ---------------------------------------------------------------------------------

# (command, arguments): threads copying in parallel (3 output files, 2 workers), kernel copies,
# a dtype cast through torch, small slabs so the copying takes a while
CTRL_C_RUNS = {
    "convert": ["--to", "dcp", "--world-size", "3", "--workers", "2", "--memory-budget", "16MB"],
    "reshard": ["--to", "3", "--workers", "2", "--memory-budget", "16MB"],
    "consolidate": ["--dtype", "bf16", "--max-shard-size", "40MB", "--workers", "2", "--memory-budget", "16MB"],
}
# where to interrupt, as fractions of an uninterrupted run: start-up and imports, indexing,
# planning, copying, the last files and the commit (8 + 8 + 4 = 20 runs; consolidate's bf16 cast
# imports torch while the output is open, and is the slowest)
FRACTIONS = {
    "convert": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75],
    "reshard": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75],
    "consolidate": [0.15, 0.35, 0.55, 0.75],
}
EARLIEST_S = 0.25  # never earlier than this (and than twice the interpreter's start-up, measured)


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("ctrl_c") / "src"
    save_random_dcp(path, 32, (2048, 1024), seed=1, name="layer{i}.weight")  # 256 MB: a run long enough
    # that every fraction lies past the interpreter's start-up on a loaded machine (at 128 MB a
    # reshard under xdist took 0.3-0.6 s, and 0.5 of it could fall before `earliest`)
    return path


def _check_interrupted(run: hostile.Run, scene: hostile.Scene) -> None:
    hostile.check_refused(run, scene=scene, code=130)
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert lines == ["interrupted"], run.detail()


@pytest.fixture(scope="module")
def earliest() -> float:
    """Until the interpreter has started and reached ckptkit's first line, Ctrl-C is Python's own
    (a KeyboardInterrupt traceback; no ckptkit code has run, nothing exists to clean up). On this
    shared machine that takes from 0.05 s to several times as long: measured, and doubled."""
    startup = max(hostile.run_python(["-c", "import ckptkit_cli.entry"]).seconds for _ in range(3))
    return max(EARLIEST_S, 2 * startup)


def _before_ckptkit_started(run: hostile.Run) -> bool:
    """The signal reached the interpreter before any ckptkit code ran (see `earliest`)."""
    return (
        run.code in (-signal.SIGINT, 1)
        and run.stderr.rstrip().endswith("KeyboardInterrupt")
        and "/cli/" not in run.stderr
        and "/ckptkit/" not in run.stderr.replace("/ckptkit/__init__.py", "")
    )


def _uninterrupted_seconds(op: str, src: Path, tmp_path: Path) -> float:
    """How long the command takes here and now: the faster of two runs (this machine is shared,
    so a single run may be slowed down by others)."""
    times = []
    for _ in range(2):
        run = hostile.run_ckptkit(op, src, tmp_path / "timed", *CTRL_C_RUNS[op])
        assert run.code == 0, run.detail()
        shutil.rmtree(tmp_path / "timed")
        times.append(run.seconds)
    return min(times)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op", list(CTRL_C_RUNS))
def test_ctrl_c_at_any_point_ends_clean(big_source, tmp_path, op, earliest):
    duration = _uninterrupted_seconds(op, big_source, tmp_path)
    for i, fraction in enumerate(FRACTIONS[op]):
        at = max(earliest, fraction * duration)
        for _attempt in range(5):
            out = tmp_path / f"out{i}"
            scene = hostile.Scene(big_source, out)
            run = hostile.run_ckptkit(op, big_source, out, *CTRL_C_RUNS[op], interrupt_after=at)
            if run.code == 0:  # done before the signal came (or while the interpreter shut down, when
                shutil.rmtree(out)  # Ctrl-C is ignored): not a test of it; earlier, at the same fraction
                at = max(earliest, min(at * 0.7, fraction * run.seconds))  # of this faster run
                continue
            if _before_ckptkit_started(run):  # the machine is slower than measured: a bit later
                at *= 1.5
                continue
            _check_interrupted(run, scene)
            break
        else:
            pytest.fail(f"{op} always finished before the interrupt at {fraction} of {duration:.2f} s")


def _run_with_interrupts(args: list[str], at: list[float], timeout: float = 60) -> hostile.Run:
    """hostile.run_ckptkit, but SIGINT at each of several times (a user pressing Ctrl-C again)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkit", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=hostile._env(),
        preexec_fn=os.setsid,
    )
    start = time.monotonic()

    def press() -> None:
        for t in at:
            time.sleep(max(0.0, start + t - time.monotonic()))
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGINT)

    presser = threading.Thread(target=press, daemon=True)
    presser.start()
    out, err = proc.communicate(timeout=timeout)
    presser.join()
    return hostile.Run(
        tuple(map(str, args)),
        proc.returncode,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        0,
        time.monotonic() - start,
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_second_ctrl_c_does_not_cut_the_cleanup_short(big_source, tmp_path, earliest):
    duration = _uninterrupted_seconds("reshard", big_source, tmp_path)
    interrupted, finished = 0, []
    for i, (fraction, gap) in enumerate([(0.3, 0.0), (0.45, 0.01), (0.6, 0.05)]):
        first = max(earliest, fraction * duration)
        for attempt in range(3):
            out = tmp_path / f"out{i}-{attempt}"
            scene = hostile.Scene(big_source, out)
            run = _run_with_interrupts(["reshard", big_source, out, *CTRL_C_RUNS["reshard"]], [first, first + gap])
            if run.code == 0:  # committed before the first signal came: a success, complete, nothing else
                assert out.is_dir() and scene.new_in_parent() == {out.name}, run.detail()
                assert "interrupted" not in run.stderr, run.detail()
                shutil.rmtree(out)
                finished.append(round(run.seconds, 2))
                first = max(earliest, min(first, run.seconds) * 0.7)  # the machine is faster now: earlier
                continue
            if _before_ckptkit_started(run):  # the machine is slower than measured: a bit later
                first *= 1.5
                continue
            _check_interrupted(run, scene)
            interrupted += 1
            break
    # how many runs are still going when Ctrl-C comes depends on the machine's load; each one that is,
    # is checked whole, and a run that finished first is retried with an earlier Ctrl-C
    assert interrupted >= 1, f"every run finished before Ctrl-C came (uninterrupted {duration:.2f} s; {finished})"


def test_ctrl_c_while_a_rank_waits_for_its_peers_ends_it_at_once(tmp_path):
    """A rank inside torch's rendezvous (init_process_group, in C++) waiting for a
    rank 0 that never comes: Ctrl-C ends it at once, with no trace, instead of after the timeout.
    Wherever it lands: in the store's connect, or in its retry delay (where, before the rendezvous
    ran in a thread of its own, the rank went on waiting until the timeout)."""
    import socket

    for delay in (0.2, 0.5, 0.9, 1.3, 1.7, 2.1, 2.6, 3.2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(
            hostile._env(),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE="2",
            RANK="1",
            LOCAL_RANK="1",
            CKPTKIT_DIST_TIMEOUT="120",
        )
        code = (
            "import sys; from ckptkit_cli import entry; entry.install(); "
            "from ckptkit.runner import distributed; print('joining', flush=True); "
            "distributed.from_environment(); print('joined')"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
        )
        try:
            assert proc.stdout.readline().strip() == "joining"
            time.sleep(delay)  # inside init_process_group now, waiting for rank 0's store
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        took = time.monotonic() - start
        assert took < 10, (delay, took, err)
        assert proc.returncode in (-signal.SIGINT, 130), (delay, proc.returncode, err)
        assert "joined" not in out and "Traceback" not in err and "Exception raised from" not in err, (delay, err)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ctrl_c_to_the_nproc_launcher_stops_every_process(big_source, tmp_path):
    """Ctrl-C to the terminal's process group while the ranks start, join the rendezvous or work:
    each run ends within seconds, says "interrupted" once and leaves nothing."""
    args = ("--to", "2", "--nproc", "2")
    timed = hostile.run_ckptkit("reshard", big_source, tmp_path / "timed", *args, timeout=120)
    assert timed.code == 0, timed.detail()
    interrupted = 0
    for i, fraction in enumerate((0.9, 0.75, 0.6, 0.45, 0.3)):  # most of a --nproc run is its processes starting
        out = tmp_path / f"out{i}"
        scene = hostile.Scene(big_source, out)
        at = fraction * timed.seconds
        run = hostile.run_ckptkit("reshard", big_source, out, *args, interrupt_after=at, timeout=120)
        if run.code == 0:  # committed before the signal came: a success, complete
            assert out.is_dir() and "interrupted" not in run.stderr, run.detail()
            shutil.rmtree(out)
            continue
        _check_interrupted(run, scene)
        assert run.seconds - at < 15, run.detail()  # not left waiting for peers that had gone
        interrupted += 1
    assert interrupted >= 1, "every --nproc run finished before its Ctrl-C came"


# ---- the pieces, in one process ----------------------------------------------------------------


def test_escape_shows_every_control_and_format_character():
    from ckptkit.text import escape

    assert escape("plain name.weight") == "plain name.weight"
    assert escape("a\nb\rc\td\x1b[2Je\x07f\x00g\x7fh\x9bi") == "a\\nb\\rc\\td\\x1b[2Je\\x07f\\x00g\\x7fh\\x9bi"
    assert escape("x\u202ey\u200bz\u2028w\ufeff") == "x\\u202ey\\u200bz\\u2028w\\ufeff"
    assert escape("caf\u00e9 \u4e2d\u6587") == "caf\u00e9 \u4e2d\u6587"  # printable text stays
    assert escape("bad\udcff byte") == "bad\\xff byte"  # surrogateescape'd byte
    assert escape(escape("a\\nb\n")) == "a\\nb\\n"  # escaping twice is harmless
    unsafe = [chr(c) for c in range(0x30000) if unicodedata.category(chr(c)) in ("Cc", "Cf", "Cs", "Zl", "Zp")]
    unsafe += ["\ue000", "\uf8ff", "\U000f0000", "\U0010fffd", "\U000e0001", "\U000e007f"]  # private use, tags
    assert len(unsafe) > 2000 and not _unsafe(escape("".join(unsafe)))


def test_an_interrupt_while_cleanup_raises_is_still_an_interrupt():
    from ckptkit.interrupts import Cancelled, is_interrupt

    def cleanup_fails_while_unwinding() -> None:
        try:
            raise KeyboardInterrupt
        finally:
            raise BufferError("cannot close exported pointers exist")

    with pytest.raises(BufferError) as info:
        cleanup_fails_while_unwinding()
    assert is_interrupt(info.value) and is_interrupt(Cancelled()) and not is_interrupt(ValueError("x"))


_CRC_UNDER_INTERRUPTS = """
import json, os, random, signal, sys
from ckptkit.storage import kernel_copy
from ckptkit.storage.source import LocalSource

source, rel = LocalSource(sys.argv[1]), sys.argv[2]

def alarm(signum, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGALRM, alarm)
rng, outcomes = random.Random(0), {}
for _ in range(150):
    signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0002, 0.01))
    try:
        while True:
            with open(os.devnull, "wb") as out:
                kernel_copy.copy_with_crc(source, [(rel, 1000, 8 << 20)], out)
    except BaseException as exc:
        outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
print(json.dumps(outcomes))
"""


def test_kernel_crc_windows_never_turn_ctrl_c_into_buffer_error(big_source):
    """The root cause of "internal error: BufferError" on Ctrl-C: a KeyboardInterrupt raised
    inside the CRC of a memory-mapped window kept a view of the map alive (in its traceback) as
    the map closed. Interrupted 150 times at random points (in a child process, so a stray
    interrupt cannot reach pytest), only KeyboardInterrupt comes out (a view kept alive
    gives ~120 BufferErrors in 150)."""
    run = hostile.run_python(["-c", _CRC_UNDER_INTERRUPTS, str(big_source), next(big_source.glob("*.distcp")).name])
    assert run.code == 0, run.detail()
    assert json.loads(run.stdout) == {"KeyboardInterrupt": 150}


def test_first_failure_stops_running_sibling_jobs():
    from ckptkit import interrupts
    from ckptkit.runner.executor import run_jobs

    stopped = threading.Event()

    def fails() -> None:
        time.sleep(0.05)
        raise ValueError("the real failure")

    def long_job() -> None:
        try:
            for _ in range(2000):  # 20 s unless stopped
                interrupts.check()
                time.sleep(0.01)
        except interrupts.Stopped:
            stopped.set()
            raise

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="the real failure"):
        run_jobs([long_job, fails, long_job], workers=3)
    assert stopped.is_set() and time.monotonic() - t0 < 5


def test_an_output_whose_block_ends_after_ctrl_c_is_removed_not_committed(tmp_path):
    from ckptkit import interrupts
    from ckptkit.storage.output import open_output

    out = tmp_path / "out"
    try:
        with pytest.raises(interrupts.Cancelled):
            with open_output(str(out)) as target:
                target.write_bytes("a.bin", b"x")
                assert interrupts.cleanup_pending()
                interrupts.cancel()  # what the CLI's handler does on Ctrl-C while an output is open
        assert not interrupts.cleanup_pending()
        assert os.listdir(tmp_path) == []  # no OUT, no temporary folder, no lock
    finally:
        interrupts.reset()


def test_diff_json_is_strict_json_with_non_finite_differences(tmp_path):
    """NaN against a number makes max |a-b| non-finite; --json must still be RFC 8259 JSON."""
    import json as _json

    import torch
    from safetensors.torch import save_file

    from helpers.hostile import run_ckptkit

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.tensor([1.0, float("nan")]), "v": torch.tensor([1.0, 2.0])}, str(a))
    save_file({"w": torch.tensor([1.0, 3.0]), "v": torch.tensor([1.0, float("inf")])}, str(b))
    run = run_ckptkit("diff", str(a), str(b), "--json")
    assert run.code == 1, run.detail()

    def refuse(token: str):
        raise AssertionError(f"non-standard JSON constant {token}\n{run.detail()}")

    doc = _json.loads(run.stdout, parse_constant=refuse)
    assert doc["equal"] is False
    values = {r["name"]: r["max_abs_diff"] for r in doc["rows"]}
    assert any(isinstance(v, str) and v in ("nan", "inf") for v in values.values()), doc


def _indented_two_levels(value, depth: int = 0) -> str:
    """The layout dump_json promises, spelled out by the json module alone."""
    import json as _json

    if depth >= 2 or not isinstance(value, (dict, list, tuple)) or not value:
        return _json.dumps(value, allow_nan=False, separators=(", ", ": "))
    pad, end = "\n" + " " * (depth + 1), "\n" + " " * depth
    if isinstance(value, dict):
        body = ",".join(
            pad + _json.dumps({k: 0})[1:-4] + ": " + _indented_two_levels(v, depth + 1) for k, v in value.items()
        )
        return "{" + body + end + "}"
    return "[" + ",".join(pad + _indented_two_levels(v, depth + 1) for v in value) + end + "]"


def test_dump_json_writes_what_the_finite_copy_would():
    """dump_json writes a document as it is unless it holds a NaN or an infinity; either way it
    parses to the copy with every non-finite number written as a string, and its layout is the
    top two levels indented, each deeper value on one line."""
    import json as _json
    import random

    from ckptkit_cli.json_output import dump_json, finite

    rng = random.Random(3)
    specials = [float("nan"), float("inf"), float("-inf")]

    def doc(depth: int, special: bool):
        if depth == 0:
            return rng.choice([1, -2.5, "s", None, True, 1e300, 0.1, *(specials if special else [])])
        kind = rng.choice(["dict", "list", "tuple"])
        items = [doc(depth - 1, special) for _ in range(rng.randint(0, 4))]
        if kind == "dict":
            return {f"k{i}" if i % 2 else i: v for i, v in enumerate(items)}
        return items if kind == "list" else tuple(items)

    seen_special = 0
    for i in range(300):
        value = doc(4, special=i % 2 == 1)
        text = dump_json(value)
        strict = _json.loads(text, parse_constant=lambda token: (_ for _ in ()).throw(AssertionError(token)))
        assert strict == _json.loads(_json.dumps(finite(value), allow_nan=False))
        assert text == _indented_two_levels(finite(value))
        seen_special += any(t in text for t in ('"nan"', '"inf"', '"-inf"'))
    assert seen_special > 10
