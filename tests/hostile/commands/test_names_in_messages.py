"""Names a checkpoint gives to its own files are quoted at most ~100 characters in a message, and a
bad --tag is blamed on the option, not on the `latest` file.

Each case is crafted here as an attacker would, run through the CLI in a subprocess
(tests/helpers/hostile.py) and held to the whole contract.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path

import pytest

from helpers.hostile import Scene, check_refused, run_ckptkit

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fixtures" / "data"
DCP = DATA / "fsdp2_w2"
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


LONG = "A" * 5000


def _longest_run_of_a(text: str) -> int:
    best = run = 0
    for ch in text:
        run = run + 1 if ch == "A" else 0
        best = max(best, run)
    return best


@pytest.mark.parametrize("where", ["safetensors-index", "dcp-relative-path"])
def test_a_file_name_from_the_metadata_is_shortened_in_the_message(tmp_path: Path, where: str) -> None:
    # Without this check: a 5,000-character shard name in model.safetensors.index.json (or a DCP relative_path
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
    # Without this check: `--tag ../x` was reported as "SRC/latest: names tag '../x'", sending the user to a
    # file that is fine.
    src = tmp_path / "src"
    shutil.copytree(DATA / "deepspeed" / "z1_fp32_w2", src)
    scene = Scene(src)
    run = run_ckptkit("inspect", src, "--tag", "../z1_fp16_w2", timeout=TIMEOUT)
    check_refused(run, str(src), "--tag", scene=scene)
    assert "latest" not in run.stderr, run.detail()
