"""The ranks of a ZeRO checkpoint whose files pickle alike are unpickled once.

DeepSpeed writes ZeRO-3's model-states file with a placeholder tensor per parameter on every
rank, and the ranks after the first (often the first too) pickle it to the very same bytes. The
reader (formats/deepspeed/reader.py, torch_archive.LastStructure) unpickles such a data.pkl once;
each other rank's archive is still checked storage by storage. What must hold: the index is the
one a load of every file gives, fewer unpickles run, and a rank whose pickle is the same but
whose archive lacks a storage record is refused with the sentence a full load gives.
"""

from __future__ import annotations

import shutil
import zipfile

import pytest

from ckptkit.errors import FormatError
from ckptkit.formats.deepspeed import reader
from ckptkit.formats.registry import open_checkpoint
from ckptkit.index.serialize import to_json
from ckptkit.runner import torch_archive
from helpers.ds_fixtures import DS_DATA, ds_fixtures

NAME = "z3_fp32_w3_subgroups"  # ranks 1 and 2 pickle their model states alike, rank 0 not (tied params)
pytestmark = pytest.mark.skipif(NAME not in ds_fixtures(), reason=f"no DeepSpeed fixture {NAME}")


class _Forgetful:
    """A memo that never serves: every file unpickled, as before LastStructure."""

    def get(self, data: bytes):
        return None

    def put(self, data: bytes, value, pids) -> None:
        pass


def _model_pickles(path) -> list[bytes]:
    out = []
    for f in sorted((path / "global_step2").glob("*model_states.pt")):
        with zipfile.ZipFile(f) as z:
            out.append(z.read(next(n for n in z.namelist() if n.endswith("/data.pkl"))))
    return out


def test_alike_ranks_give_the_index_a_full_load_gives(monkeypatch):
    pickles = _model_pickles(DS_DATA / NAME)
    assert pickles[1] == pickles[2] != pickles[0]  # what the test relies on (DeepSpeed's own files)
    loads = []
    real = torch_archive.fenced_torch_save_loads
    monkeypatch.setattr(
        torch_archive, "fenced_torch_save_loads", lambda data, *a: (loads.append(data), real(data, *a))[1]
    )
    remembered = to_json(open_checkpoint(str(DS_DATA / NAME)).index)
    assert sum(data in pickles for data in loads) == 2  # rank 0's and rank 1's; rank 2 served by rank 1's
    loads.clear()
    monkeypatch.setattr(reader, "LastStructure", _Forgetful)
    assert to_json(open_checkpoint(str(DS_DATA / NAME)).index) == remembered
    assert sum(data in pickles for data in loads) == 3


def test_an_alike_rank_without_a_storage_record_is_refused(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DS_DATA / NAME, ckpt)
    victim = sorted((ckpt / "global_step2").glob("*model_states.pt"))[2]
    with zipfile.ZipFile(victim) as z:
        names = z.namelist()
    record = max((n for n in names if "/data/" in n), key=len)  # e.g. archive/data/12: renamed, same length
    renamed = record[:-1] + ("x" if record[-1] != "x" else "y")
    data = victim.read_bytes()
    assert data.count(record.encode()) == 2  # its local header and its directory entry
    victim.write_bytes(data.replace(record.encode(), renamed.encode()))
    assert _model_pickles(ckpt)[2] == _model_pickles(ckpt)[1]  # the pickle itself is untouched
    with pytest.raises(FormatError, match=rf"{victim.name}: archive has no storage record {record}$") as served:
        open_checkpoint(str(ckpt))
    monkeypatch.setattr(reader, "LastStructure", _Forgetful)
    with pytest.raises(FormatError) as loaded:
        open_checkpoint(str(ckpt))
    assert str(served.value) == str(loaded.value)
