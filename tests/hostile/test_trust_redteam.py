"""Red team for issue 12: variants of the hostile cases the other trust tests do not cover.

Each case is a hole found by attacking the finished defences with new variants (a NUL byte in a
path a checkpoint names, a FIFO given to an option, ...), crafted here as an attacker would,
run through the CLI in a subprocess (tests/hostile.py) and held to the whole contract.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from pathlib import Path

import pytest

from helpers.hostile import Scene, check_refused, rss_bound, run_ckptkit

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "fixtures" / "data"
DCP = DATA / "fsdp2_w2"
DS_CONFIG = DATA / "deepspeed" / "z2_fp32_w2" / "ds_config.json"
BUDGET = 256 << 20
TIMEOUT = 30.0


def _dcp_pointing_at(tmp_path: Path, relative_path: str) -> Path:
    """A copy of a real DCP checkpoint whose .metadata sends rank 0's items to `relative_path`."""
    src = tmp_path / "src"
    shutil.copytree(DCP, src)
    md = pickle.loads((src / ".metadata").read_bytes())
    for key, info in list(md.storage_data.items()):
        if info.relative_path == "__0_0.distcp":
            md.storage_data[key] = dataclasses.replace(info, relative_path=relative_path)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    return src


@pytest.mark.parametrize("cmd", ["inspect", "consolidate"])
def test_dcp_relative_path_with_a_nul_byte_is_one_sentence(tmp_path: Path, cmd: str) -> None:
    # Found: os.stat raised "ValueError: embedded null byte", shown as an internal error (exit 3).
    src = _dcp_pointing_at(tmp_path, "__0_0.distcp\0/../../etc/passwd")
    out = tmp_path / "out"
    scene = Scene(src, out)
    args = ["inspect", src] if cmd == "inspect" else [cmd, src, out, "--memory-budget", str(BUDGET)]
    run = run_ckptkit(*args, timeout=TIMEOUT)
    check_refused(run, str(src), scene=scene, rss_limit=rss_bound(BUDGET, (src / ".metadata").stat().st_size))


def test_verify_lists_a_nul_byte_path_as_a_problem(tmp_path: Path) -> None:
    src = _dcp_pointing_at(tmp_path, "a\0b")
    scene = Scene(src)
    run = run_ckptkit("verify", "--deep", src, timeout=TIMEOUT)
    assert run.code == 1, run.detail()
    assert "internal error" not in run.output and "Traceback" not in run.output, run.detail()
    assert "a\\x00b" in run.stdout + run.stderr, run.detail()
    assert scene.source_unchanged()


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_ds_config_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    # Found: a FIFO given as --ds-config blocked `convert` forever in open().
    src = tmp_path / "src"
    shutil.copytree(DCP, src)
    config = tmp_path / "ds_config.json"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "device":
        os.symlink("/dev/zero", config)
    else:
        config.mkdir()
    out = tmp_path / "out"
    scene = Scene(src, out)
    run = run_ckptkit("convert", src, out, "--to", "zero2", "--world-size", "2", "--ds-config", config, timeout=TIMEOUT)
    check_refused(run, str(config), scene=scene)


def test_ds_config_that_is_a_regular_file_still_works(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(DCP, src)
    out = tmp_path / "out"
    run = run_ckptkit(
        "convert", src, out, "--to", "deepspeed", "--world-size", "2", "--ds-config", DS_CONFIG, timeout=120
    )
    assert run.code == 0, run.detail()
    assert (out / "latest").is_file()


# ---- hostile client state inside real DeepSpeed files (refused already; no other test covers it) --

DS = DATA / "deepspeed" / "z1_fp32_w2"
MODEL_FILE = "global_step2/mp_rank_00_model_states.pt"
OPTIM_FILE = "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"


class _HugeBytearray:
    def __reduce__(self):  # the pickle calls bytearray(1.5e9): 8 bytes in the file
        return (bytearray, (1_500_000_000,))


def _shared_lists(levels: int = 40) -> list:
    x: list = []
    for _ in range(levels):
        x = [x, x]  # pickled once through the memo, 2**40 values when walked
    return x


def _nested(depth: int = 600) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def _structured_array():
    import numpy as np

    return np.zeros(4, dtype=[("a", "<i8"), ("b", "<f4")])


PAYLOADS = {
    "structured-numpy": (MODEL_FILE, _structured_array),
    "huge-bytearray": (OPTIM_FILE, _HugeBytearray),
    "shared-lists": (OPTIM_FILE, _shared_lists),
    "deep-nesting": (MODEL_FILE, _nested),
}


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_hostile_client_state_in_a_deepspeed_file_is_refused_by_consolidate(tmp_path: Path, payload: str) -> None:
    import sys

    import torch

    rel, make = PAYLOADS[payload]
    src = tmp_path / "src"
    shutil.copytree(DS, src)
    target = src / rel
    obj = torch.load(target, weights_only=False)  # the fixture is trusted; the crafted copy is not
    obj["client_state_hostile"] = make()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        torch.save(obj, target)
    finally:
        sys.setrecursionlimit(limit)
    out = tmp_path / "out"
    scene = Scene(src, out)
    run = run_ckptkit("consolidate", src, out, "--memory-budget", str(64 << 20), timeout=TIMEOUT)
    check_refused(run, str(target), scene=scene, rss_limit=rss_bound(64 << 20, target.stat().st_size))


# ---- names a checkpoint gives to its own files are quoted at most ~100 characters -----------------

LONG = "A" * 5000


def _longest_run_of_a(text: str) -> int:
    best = run = 0
    for ch in text:
        run = run + 1 if ch == "A" else 0
        best = max(best, run)
    return best


@pytest.mark.parametrize("where", ["safetensors-index", "dcp-relative-path"])
def test_a_file_name_from_the_metadata_is_shortened_in_the_message(tmp_path: Path, where: str) -> None:
    # Found: a 5,000-character shard name in model.safetensors.index.json (or a DCP relative_path
    # inside the folder) came back whole in "error: SRC/AAAA...: ... is missing".
    import json
    import struct

    if where == "safetensors-index":
        src = tmp_path / "src"
        src.mkdir()
        header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
        (src / "model-1.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
        (src / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"w": "model-1.safetensors", "v": LONG + ".safetensors"}})
        )
    else:
        src = _dcp_pointing_at(tmp_path, "sub/" + LONG)
    out = tmp_path / "out"
    scene = Scene(src, out)
    run = run_ckptkit("consolidate", src, out, timeout=TIMEOUT)
    check_refused(run, str(src), scene=scene)
    assert _longest_run_of_a(run.stderr) <= 100, run.detail()


def test_a_bad_tag_option_is_blamed_on_the_option_not_on_latest(tmp_path: Path) -> None:
    # Found: `--tag ../x` was reported as "SRC/latest: names tag '../x'", sending the user to a
    # file that is fine.
    src = tmp_path / "src"
    shutil.copytree(DATA / "deepspeed" / "z1_fp32_w2", src)
    scene = Scene(src)
    run = run_ckptkit("inspect", src, "--tag", "../z1_fp16_w2", timeout=TIMEOUT)
    check_refused(run, str(src), "--tag", scene=scene)
    assert "latest" not in run.stderr, run.detail()


# ---- a source's files that live elsewhere through links are the source too ------------------------


def _hf_snapshot(tmp_path: Path) -> tuple[Path, Path]:
    """A Hugging Face cache repo: snapshots/<rev>/model.safetensors -> ../../blobs/<hash>."""
    import json
    import struct

    repo = tmp_path / "models--org--model"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (blobs / "9f86d081").write_bytes(struct.pack("<Q", len(header)) + header + b"\1" * 8)
    os.symlink("../../blobs/9f86d081", snap / "model.safetensors")
    return snap, blobs


def test_overwriting_the_blobs_folder_of_a_hugging_face_snapshot_is_refused(tmp_path: Path) -> None:
    # Found: `consolidate SNAPSHOT REPO/blobs --overwrite` exited 0 and deleted the blob the
    # snapshot's model.safetensors links to: the source was gone.
    snap, blobs = _hf_snapshot(tmp_path)
    scene = Scene(blobs, blobs)  # the blobs are the source's bytes
    run = run_ckptkit("consolidate", snap, blobs, "--overwrite", timeout=TIMEOUT)
    check_refused(run, str(blobs), scene=scene, out_may_exist=True)
    assert (snap / "model.safetensors").read_bytes().endswith(b"\1" * 8)


def test_an_output_beside_the_blobs_still_works(tmp_path: Path) -> None:
    snap, blobs = _hf_snapshot(tmp_path)
    out = blobs / "new-output"
    run = run_ckptkit("consolidate", snap, out, timeout=TIMEOUT)
    assert run.code == 0, run.detail()
    assert (snap / "model.safetensors").read_bytes().endswith(b"\1" * 8)


@pytest.mark.parametrize("cmd", ["inspect", "consolidate", "convert"])
def test_two_entries_that_flatten_to_one_name_are_refused_not_merged(tmp_path: Path, cmd: str) -> None:
    """{"a.b": x, "a": {"b": y}}: both join to the name "a.b". Kept silently, one hid the other
    (inspect counted 1 tensor, convert wrote one of them, exit 0)."""
    import torch

    src = tmp_path / "two.pt"
    torch.save({"model": {"a.b": torch.ones(3), "a": {"b": torch.zeros(3)}}}, src)
    out = tmp_path / "out"
    scene = Scene(src, out if cmd != "inspect" else None)
    extra = {"inspect": [], "consolidate": [str(out)], "convert": [str(out), "--to", "torch"]}[cmd]
    run = run_ckptkit(cmd, src, *extra)
    check_refused(run, str(src), "same name", "model.a.b", scene=scene)
