"""zip_records packs zip records directly (a ZeRO-3 model-states file is 20k empty
placeholder tensors, each a zipfile member). Its bytes must be zipfile's own: checked here on
random archives (plain and aligned members, empty and not, past 255 and 65535 members), and at
run time by matches_zipfile, which the archive writer asks before using it."""

from __future__ import annotations

import io
import random

import pytest
import torch

from ckptkit.formats.torch_save import archive_writer as aw
from ckptkit.formats.torch_save import zip_records as zr
from ckptkit.index.types import Box, Encoding, Location, Piece, TensorEntry
from ckptkit.runner.fetch import Fetcher
from ckptkit.storage.source import BytesSource
from ckptkit.torch_types import SmallTensor

DATE = (1980, 1, 1, 0, 0, 0)


def _members(rng: random.Random, count: int) -> list[tuple[str, bytes, int]]:
    out = [("archive/data.pkl", rng.randbytes(rng.randrange(600)), 0), ("archive/byteorder", b"little", 0)]
    out += [(f"archive/data/{i}", rng.randbytes(rng.choice([0, 0, 1, 7, 63, 64, 65, 1000])), 64) for i in range(count)]
    out.append(("archive/version", b"3\n", 0))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_records_are_zipfiles_bytes(seed: int) -> None:
    rng = random.Random(seed)
    members = _members(rng, rng.choice([0, 1, 3, 255, 256, 300]))
    assert zr.records_bytes(members, DATE) == zr.zipfile_bytes(members, DATE)


def test_past_65535_members_zip64_end_records() -> None:
    members = [(f"archive/data/{i}", b"", 64) for i in range(65536 + 10)]
    made = zr.records_bytes(members, DATE)
    assert made == zr.zipfile_bytes(members, DATE)
    assert b"PK\x06\x06" in made[-200:]  # the case that needs ZIP64 end records is the one checked


def test_matches_zipfile_here() -> None:
    assert zr.matches_zipfile(DATE, aw.ALIGN)


def test_small_archive_same_as_zipfile(monkeypatch: pytest.MonkeyPatch) -> None:
    """write_archive_to's in-memory archive: the same bytes with the records as through zipfile
    (lazy tensors read from a source, empty ones, small in-memory ones), and torch reads it."""
    raw = bytes(range(48))
    source = BytesSource(raw, "test")

    def lazy(key: str, shape: tuple[int, ...], offset: int) -> aw.LazyTensor:
        nbytes = 4 * (shape[0] if shape else 1)
        return aw.LazyTensor(
            TensorEntry(key, "float32", shape, [Piece(Box.whole(shape), Location("f", offset, nbytes, Encoding.RAW))])
        )

    structure = {
        "a": lazy("a", (4,), 0),
        "empty": [lazy(f"e{i}", (0,), 0) for i in range(300)],
        "b": lazy("b", (3,), 16),
        "s": SmallTensor("int64", (2,), bytes(16)),
    }

    def written() -> bytes:
        buf = io.BytesIO()
        aw.write_archive_to(buf, structure, Fetcher(source), slab_bytes=1 << 20)
        return buf.getvalue()

    direct = written()
    monkeypatch.setattr(aw, "_records_archive", lambda *a: None)
    assert direct == written()
    loaded = torch.load(io.BytesIO(direct), weights_only=True)
    assert loaded["a"].tolist() == torch.frombuffer(bytearray(raw[:16]), dtype=torch.float32).tolist()
    assert len(loaded["empty"]) == 300 and loaded["empty"][7].shape == (0,)
