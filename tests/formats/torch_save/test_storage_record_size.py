"""A torch.save storage record must hold exactly the bytes its persistent id declares (numel x the
storage type's element size), as torch.load requires: a longer record was read by ckptkit as the
first bytes of it, so a storage type changed from Float to Half read half-floats out of float bytes
while torch refuses the file."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import oracle_pickle as P
from helpers.oracle_zip import find, read_members, with_data, write
from helpers.hostile import Scene, check_refused, run_ckptkit


def _saved(tmp_path):
    path = tmp_path / "src.pt"
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}, path)
    return path


def _record_longer(members):
    i = find(members, "data/0")
    return with_data(members, i, members[i].data + bytes(8))


def _record_shorter(members):
    i = find(members, "data/1")
    return with_data(members, i, members[i].data[:-4])


def _storage_type_half(members):
    i = find(members, "data.pkl")
    ops = P.parse(members[i].data)
    pid = next(p for p in P.persid_ops(ops) if p["key_name"] == "0")
    return with_data(members, i, P.encode(P.set_storage_type(ops, pid, "HalfStorage")))


@pytest.mark.parametrize(
    "change",
    [_record_longer, _record_shorter, _storage_type_half],
    ids=["record-longer", "record-shorter", "float-record-read-as-half"],
)
def test_a_storage_record_of_another_size_than_declared_is_refused(tmp_path, change):
    src = tmp_path / "bad.pt"
    write(src, change(read_members(_saved(tmp_path))))
    with pytest.raises(RuntimeError, match="record size"):
        torch.load(src, weights_only=True)  # the framework refuses it too
    scene = Scene(src, tmp_path / "out")
    storage = "storage 1" if change is _record_shorter else "storage 0"
    check_refused(run_ckptkit("verify", "--deep", str(src)), str(src), storage, scene=scene, code=1)  # listed
    check_refused(run_ckptkit("consolidate", str(src), str(tmp_path / "out")), str(src), scene=scene)


def test_a_record_of_the_declared_size_reads_as_torch_load(tmp_path):
    src = tmp_path / "good.pt"
    write(src, [replace(m) for m in read_members(_saved(tmp_path))])  # rebuilt member by member, unchanged
    from conftest import read_all

    _, tensors, _ = read_all(src)
    truth = torch.load(src, weights_only=True)
    assert set(tensors) == set(truth)
    for key, value in truth.items():
        assert torch.equal(tensors[key], value), key
