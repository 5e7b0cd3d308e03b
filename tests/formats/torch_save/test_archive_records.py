"""The records torch's zip reader checks before reading a tensor (every member inside the archive's
folder, a version record torch reads, a storage alignment that is a number, a serialization id
that is text) are checked by ckptkit
the same way: an archive torch.load refuses for them is refused in one sentence, one it reads is
read to the same values."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import read_all
from helpers.oracle_zip import find, read_members, with_data, write
from helpers.hostile import Scene, check_refused, run_ckptkit


def _saved(tmp_path):
    path = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32), "n": torch.tensor([1, 2], dtype=torch.int64)}, path)
    return read_members(path)


def _drop(members, suffix):
    i = find(members, suffix)
    return members[:i] + members[i + 1 :]


def _moved(members, suffix):
    i = find(members, suffix)
    out = list(members)
    out[i] = replace(members[i], name="elsewhere/" + suffix)
    return out


REFUSED = {  # change -> (words of ckptkit's sentence, words of torch's refusal)
    "version-missing": (lambda m: _drop(m, "version"), "no version record", "version"),
    "version-empty": (lambda m: with_data(m, find(m, "version"), b""), "version record", "version"),
    "version-too-new": (lambda m: with_data(m, find(m, "version"), b"128"), "version record", "version"),
    "version-zero": (lambda m: with_data(m, find(m, "version"), b"0"), "version record", "version"),
    "version-no-number": (lambda m: with_data(m, find(m, "version"), b"abc"), "version record", "parse"),
    "member-outside-the-folder": (lambda m: _moved(m, "byteorder"), "outside the archive's folder", "subdirectory"),
    "storage-alignment-no-number": (
        lambda m: with_data(m, find(m, ".storage_alignment"), b""),
        ".storage_alignment",
        "invalid literal",
    ),
    "serialization-id-no-text": (
        lambda m: with_data(m, find(m, ".data/serialization_id"), b"\x95" * 40),
        "serialization_id",
        "utf-8",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_archive_record_torch_refuses_is_refused(tmp_path, case):
    change, ours, theirs = REFUSED[case]
    src = tmp_path / "bad.pt"
    write(src, change(_saved(tmp_path)))
    with pytest.raises(Exception, match=theirs):
        torch.load(src, weights_only=True)
    scene = Scene(src, tmp_path / "out")
    check_refused(run_ckptkit("consolidate", str(src), str(tmp_path / "out")), str(src), ours, scene=scene)


@pytest.mark.parametrize("version", [b"1", b"3\n", b"10", b" 3 "])
def test_a_version_torch_reads_reads_as_torch_load(tmp_path, version):
    src = tmp_path / "ok.pt"
    members = _saved(tmp_path)
    write(src, with_data(members, find(members, "version"), version))
    truth = torch.load(src, weights_only=True)
    _, tensors, _ = read_all(src)
    assert set(tensors) == set(truth)
    for key, value in truth.items():
        assert torch.equal(tensors[key], value), key
