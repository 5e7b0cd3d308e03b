"""A source's files that live elsewhere through links are the source too: OUT that is the blobs
folder of a Hugging Face cache snapshot is refused under --overwrite; an output beside the blobs
still works.

Each case is crafted here as an attacker would, run through the CLI in a subprocess
(tests/helpers/hostile.py) and held to the whole contract.
"""

from __future__ import annotations

import os
from pathlib import Path


from helpers.hostile import Scene, check_refused, run_ckptkit

TIMEOUT = 30.0


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
    # Without this check: `consolidate SNAPSHOT REPO/blobs --overwrite` exited 0 and deleted the blob the
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
