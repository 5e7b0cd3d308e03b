"""Nothing unbounded happens inside Python's C unpickler before ckptkit's checks run.

Python's C unpickler hashes every dictionary key recursively in C (no recursion limit, no Ctrl-C,
no clock) and sizes its memo for the largest index named. Each class of attack is crafted here in
several shapes (fresh nesting through TUPLE1, TUPLE2 and MARK/TUPLE; nesting and sharing through
the memo by BINPUT/BINGET, MEMOIZE/LONG_BINGET, DUP and a stand-in's arguments; a memo index near
the file's size; a flood of MEMOIZE) and put where the fenced roads read pickles: a DCP
`.metadata`, a torch.save `data.pkl`, and a torch.save archive inside a DCP bytes item. Each is run
through the CLI under tests/helpers/hostile.py: exit 2 with one sentence naming the file (verify: its
problem listed, exit 1), within the time and memory bound (max(budget, 2 x file) + 100 MB),
source unchanged.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import hostile
from helpers.memory_craft import replace_item, save_dcp

from ckptkit.safeload import dcp as safeload_dcp, torchsave as safeload_torchsave

BUDGET = "64MB"
BUDGET_BYTES = 64 * 10**6
TIMEOUT = 90.0
_KEY = b"K\x01s."  # the value 1 under the key just built, STOP


def _j(index: int) -> bytes:
    return b"j" + index.to_bytes(4, "little")


# ---- keys nested deep (each a dict whose key is one tuple nested `depth` deep) -----------------


def deep_tuple1(depth: int = 1_000_000) -> bytes:
    return b"\x80\x02}K\x01" + b"\x85" * depth + _KEY


def deep_tuple2(depth: int = 400_000) -> bytes:
    return b"\x80\x02}K\x01" + b"K\x01\x86" * depth + _KEY


def deep_marks(depth: int = 300_000) -> bytes:
    return b"\x80\x02}" + b"(K\x01" * depth + b"K\x01" + b"t" * depth + _KEY


def deep_binget(depth: int = 250_000) -> bytes:
    """Each level fetches the one before from the memo (BINPUT 0 rewritten each time, POPped)."""
    return b"\x80\x02}K\x01q\x000" + b"h\x00\x85q\x000" * depth + b"h\x00" + _KEY


def deep_memoize(depth: int = 200_000) -> bytes:
    """Protocol 4: each level a TUPLE2 of the level before (LONG_BINGET) and 1, MEMOIZEd, kept
    in a list; then a dict keyed by the last."""
    levels = b"".join(_j(k + 1) + b"K\x01\x86\x94" for k in range(depth))
    return b"\x80\x04]\x94(K\x01\x94" + levels + b"e}(" + _j(depth + 1) + b"K\x01u."


# ---- keys of shared levels (t = (t, t)): 2**levels values when hashed --------------------------


def shared_dup(levels: int = 40) -> bytes:
    return b"\x80\x02}K\x01" + b"2\x86" * levels + _KEY


def shared_binget(levels: int = 40) -> bytes:
    return b"\x80\x02}K\x01q\x000" + b"h\x00h\x00\x86q\x000" * levels + b"h\x00" + _KEY


def shared_memoize(levels: int = 40) -> bytes:
    levels_ = b"".join(_j(k + 1) + _j(k + 1) + b"\x86\x94" for k in range(levels))
    return b"\x80\x04]\x94(K\x01\x94" + levels_ + b"e}(" + _j(levels + 1) + b"K\x01u."


def shared_marks(levels: int = 40) -> bytes:
    levels_ = b"".join(b"(" + _j(k + 1) * 3 + b"t\x94" for k in range(levels))
    return b"\x80\x04]\x94(K\x01\x94" + levels_ + b"e}(" + _j(levels + 1) + b"K\x01u."


def shared_stand_in(levels: int = 40) -> bytes:
    """A DCP stand-in (MetadataIndex) built from two copies of the one before, as a key."""
    cls = b"\x8c\x25torch.distributed.checkpoint.metadata\x94\x8c\x0dMetadataIndex\x94\x93\x94"
    # memo: 0 the list, 1 module, 2 name, 3 class, 4 the first value
    levels_ = b"".join(b"h\x03" + _j(4 + 2 * k) + _j(4 + 2 * k) + b"\x86\x94R\x94" for k in range(levels))
    return b"\x80\x04]\x94(" + cls + b"K\x01\x94" + levels_ + b"e}(" + _j(4 + 2 * levels) + b"K\x01u."


DEEP = [deep_tuple1, deep_tuple2, deep_marks, deep_binget, deep_memoize]
SHARED = [shared_dup, shared_binget, shared_memoize, shared_marks, shared_stand_in]


# ---- memo indexes --------------------------------------------------------------------------------


def memo_index_near_size(size: int = 40 * 10**6) -> bytes:
    """One LONG_BINPUT naming an index close to the file's size, then a string that fills it."""
    head = b"\x80\x02K\x01r" + (size - 64).to_bytes(4, "little") + b"0X"
    pad = size - len(head) - 5
    return head + pad.to_bytes(4, "little") + b"x" * pad + b"."


def memo_flood(size: int = 40 * 10**6) -> bytes:
    return b"\x80\x04N" + b"\x94" * (size - 4) + b"."


# ---- where the roads read pickles ----------------------------------------------------------------


def dcp_with_metadata(folder: Path, pickle_bytes: bytes) -> Path:
    save_dcp(folder, {"w": torch.arange(4.0)})
    (folder / ".metadata").write_bytes(pickle_bytes)
    return folder / ".metadata"


def torch_save_file(path: Path, pickle_bytes: bytes) -> Path:
    path.write_bytes(_archive(pickle_bytes))
    return path


def _archive(pickle_bytes: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
    return out.getvalue()


def dcp_with_bytes_item(folder: Path, pickle_bytes: bytes) -> Path:
    save_dcp(folder, {"w": torch.arange(4.0), "extra": {"step": 3}})
    name = replace_item(folder, "extra.step", _archive(pickle_bytes))
    return folder / name


PLACES = {
    "dcp_metadata": dcp_with_metadata,
    "torch_save": lambda d, b: torch_save_file(d / "model.pt", b),
    "dcp_bytes_item": dcp_with_bytes_item,
}


def _source(place: str, hostile_file: Path, tmp_path: Path) -> Path:
    return hostile_file if place == "torch_save" else tmp_path / "ck"


def _refused(cmd: str, place: str, pickle_bytes: bytes, tmp_path: Path, timeout: float = TIMEOUT) -> None:
    folder = tmp_path / "ck"
    folder.mkdir(exist_ok=True)
    hostile_file = PLACES[place](folder if place != "torch_save" else tmp_path, pickle_bytes)
    src = _source(place, hostile_file, tmp_path)
    scene = hostile.Scene(src)
    args = (
        ("inspect", src, "--memory-budget", BUDGET)
        if cmd == "inspect"
        else ("verify", "--deep", src, "--memory-budget", BUDGET)
    )
    run = hostile.run_ckptkit(*args, timeout=timeout)
    bound = hostile.rss_bound(BUDGET_BYTES, hostile_file.stat().st_size, with_torch=cmd != "inspect")
    hostile.check_refused(run, hostile_file.name, scene=scene, rss_limit=bound, code=1 if cmd == "verify" else 2)


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("craft", DEEP, ids=lambda f: f.__name__)
def test_a_key_nested_deep_is_refused_in_one_sentence(craft, place, tmp_path):
    _refused("inspect", place, craft(), tmp_path)


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("craft", SHARED, ids=lambda f: f.__name__)
def test_a_key_of_shared_levels_is_refused_quickly(craft, place, tmp_path):
    _refused("inspect", place, craft(), tmp_path, timeout=30.0)


@pytest.mark.parametrize("craft", [deep_tuple1, shared_dup, shared_memoize], ids=lambda f: f.__name__)
def test_verify_refuses_the_crafted_keys_too(craft, tmp_path):
    _refused("verify", "dcp_metadata", craft(), tmp_path)


@pytest.mark.parametrize("place", ["dcp_metadata", "torch_save"])
@pytest.mark.parametrize("craft", [memo_index_near_size, memo_flood], ids=lambda f: f.__name__)
def test_a_memo_the_size_of_the_file_stays_within_the_budget(craft, place, tmp_path):
    _refused("inspect", place, craft(), tmp_path)


@pytest.mark.parametrize("craft", DEEP + SHARED, ids=lambda f: f.__name__)
def test_the_fenced_roads_decline_every_shape_before_the_c_unpickler_sees_it(craft):
    """The fast roads hand each crafted pickle to the machine (None) without hashing the key:
    this returns at all, in this very process (a crash or a hang would end the test run)."""
    data = craft()
    assert safeload_dcp.load(data) is None
    assert safeload_torchsave.load(data, lambda pid: None) is None


def test_ctrl_c_stops_inspect_of_a_shared_key_within_a_second(tmp_path):
    """Interrupted at several moments, inspect ends within a second of the signal: 130, or the
    refusal (2) where it had finished before."""
    folder = tmp_path / "ck"
    folder.mkdir()
    dcp_with_metadata(folder, shared_dup())
    for at in (0.5, 1.5, 3.0):
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptkit", "inspect", str(folder)],
            env=hostile._env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        time.sleep(at)
        sent = time.monotonic()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=max(1.0, 20.0 - at))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"inspect did not end after Ctrl-C at {at} s")
        assert proc.returncode in (2, 130), (at, proc.returncode)
        assert proc.returncode == 2 or time.monotonic() - sent < 1.5, at


_RESTORE = textwrap.dedent("""
    import sys, warnings, torch
    from ckptkit.hooks.checkpointer import Checkpointer
    directory = sys.argv[1]
    model = torch.nn.Linear(3, 2)
    ck = Checkpointer(directory, rng=False)
    ck.save(1, model)
    ck.wait()
    stray = __import__("pathlib").Path(directory) / "step_2"
    stray.mkdir()
    (stray / ".metadata").write_bytes(open(sys.argv[2], "rb").read())
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        print("restored", ck.restore(torch.nn.Linear(3, 2)))
""")


@pytest.mark.parametrize("craft", [shared_dup, shared_memoize, deep_memoize], ids=lambda f: f.__name__)
def test_checkpointer_restore_skips_a_stray_step_with_a_crafted_key(craft, tmp_path):
    crafted = tmp_path / "crafted"
    crafted.write_bytes(craft())
    proc = subprocess.run(
        [sys.executable, "-c", _RESTORE, str(tmp_path / "run"), str(crafted)],
        env=hostile._env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restored 1" in proc.stdout, proc.stdout + proc.stderr[-3000:]
