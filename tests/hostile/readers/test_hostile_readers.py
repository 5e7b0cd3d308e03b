"""Hostile inputs against the DCP and safetensors readers, held to docs/reliability.md (bad input
gets one sentence and a non-zero exit, never exit 0 with wrong values or an output no loader
accepts, never an internal error):

- a compressed DCP item (stream.zstd) is checked against .metadata for every storage record that
  points at it, also when the decoded item is cached by (file, offset): a second record reading the
  same bytes as another dtype or shape is refused, not written as the first record's values;
- the safetensors header is checked as strictly as the format: overlaps hidden behind a zero-length
  tensor, `true` as a dimension (bool is an int), and dimensions whose product exceeds 64 bits when
  another is 0 are refused, never copied into an output safetensors itself refuses to load.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptkit_cli.main import cli

DATA = Path(__file__).resolve().parents[3] / "fixtures" / "data"
ZSTD = DATA / "dcp_zstd_w2"


def _invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _refused(res, *names: str) -> None:
    """Exit 2, one `error: ` line naming `names`, no traceback and no internal error."""
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    for name in names:
        assert name in lines[0], res.output


# ---- compressed DCP items: two storage records over the same bytes ------------------------------


def _zstd_with_shared_item(tmp_path: Path, donor: tuple[str, int], victim: tuple[str, int]) -> Path:
    """A copy of dcp_zstd_w2 whose `victim` chunk's storage record points at the `donor` chunk's
    compressed item (chunks numbered in offset order)."""
    if not ZSTD.is_dir():
        pytest.skip("no dcp_zstd_w2 fixture")
    d = tmp_path / "ckpt"
    shutil.copytree(ZSTD, d)
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # trusted: our own copy of a fixture (test side only)

    def key(fqn: str, i: int):
        return sorted((mi for mi in md.storage_data if mi.fqn == fqn), key=lambda m: tuple(m.offset))[i]

    src = md.storage_data[key(*donor)]
    assert src.transform_descriptors, "the fixture's items are expected compressed"
    vk = key(*victim)
    md.storage_data[vk] = dataclasses.replace(
        md.storage_data[vk],
        relative_path=src.relative_path,
        offset=src.offset,
        length=src.length,
        transform_descriptors=src.transform_descriptors,
    )
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return d


def test_shared_compressed_item_of_another_dtype_is_caught_by_verify_deep(tmp_path):
    """verify --deep decodes each item afresh: it names the mismatch (the check the cache skips)."""
    d = _zstd_with_shared_item(tmp_path, ("model.norm.bias", 1), ("model.positions", 0))
    res = _invoke("verify", "--deep", d)
    assert res.exit_code == 1, res.output
    assert "model.positions" in res.output and "metadata says int64" in res.output, res.output


def test_shared_compressed_item_of_another_dtype_is_refused(tmp_path):
    d = _zstd_with_shared_item(tmp_path, ("model.norm.bias", 1), ("model.positions", 0))
    out = tmp_path / "out"
    res = _invoke("consolidate", d, out)
    if res.exit_code == 0:  # what happens today: the values are not the item's
        got = load_file(str(out / "model.safetensors"))["positions"]
        assert not torch.equal(got, torch.arange(5)), got
    _refused(res, "model.positions", "int64")
    assert not out.exists()


def test_shared_compressed_item_of_another_shape_is_refused(tmp_path):
    d = _zstd_with_shared_item(tmp_path, ("model.pos", 0), ("model.embed.weight", 0))
    out = tmp_path / "out"
    _refused(_invoke("consolidate", d, out), "model.embed.weight")
    assert not out.exists()


# ---- safetensors headers looser than the format -------------------------------------------------

DATA16 = torch.arange(16, dtype=torch.float32).numpy().tobytes()


def _safetensors(path: Path, header: dict, data: bytes = DATA16) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _loadable(path: Path) -> bool:
    try:
        load_file(str(path))
    except Exception:  # safetensors' own refusal of the header
        return False
    return True


def test_overlap_between_neighbours_is_refused(tmp_path):
    """The check that holds: two tensors sharing bytes, side by side in offset order."""
    f = _safetensors(
        tmp_path / "x.safetensors",
        {
            "A": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
            "C": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
        },
    )
    _refused(_invoke("inspect", f), "x.safetensors", "overlap")


HEADERS = {
    "zero-length tensor hides an overlap": {  # A and C share bytes 16..32; Z (empty) sorts between them
        "A": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
        "Z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
        "C": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
    },
    "a boolean dimension": {"A": {"dtype": "F32", "shape": [True, 16], "data_offsets": [0, 64]}},
    "a dimension past 64 bits": {
        "A": {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]},
        "B": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
    },
    "dimensions whose product overflows": {
        "A": {"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]},
        "B": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
    },
    "a name that is no UTF-8 text (a lone surrogate)": {
        "A\ud800": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}
    },
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_the_format_refuses_these_headers(tmp_path, case):
    """safetensors itself refuses each header below (the premise of the test after it)."""
    assert not _loadable(_safetensors(tmp_path / "x.safetensors", HEADERS[case]))


@pytest.mark.parametrize("case", list(HEADERS))
def test_a_header_the_format_refuses_is_refused(tmp_path, case):
    f = _safetensors(tmp_path / "x.safetensors", HEADERS[case])
    out = tmp_path / "out"
    res = _invoke("consolidate", f, out)
    _refused(res, "x.safetensors")
    assert not out.exists()
