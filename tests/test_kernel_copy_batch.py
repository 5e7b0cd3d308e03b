"""storage/kernel_copy with many small ranges (a ZeRO partition's slices): small ranges are read
with one pread each and written together, large ones copied in the kernel; the bytes written and
the CRC32 must be those of the ranges concatenated, in order, whatever the mix."""
from __future__ import annotations

import random
import zlib

import pytest

from ckptkit.storage import kernel_copy
from ckptkit.storage.source import LocalSource


@pytest.mark.parametrize("seed", range(6))
def test_copy_and_crc_are_the_ranges_concatenated(tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    files = {name: rng.randbytes(rng.choice([300, 200_000, 3 << 20])) for name in ("a", "b")}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    memory = rng.randbytes(5000)
    ranges, want = [], b""
    for _ in range(rng.randint(1, 400)):
        kind = rng.random()
        big = rng.random() < 0.05
        if kind < 0.1:
            n = rng.randint(0, (3 << 20) if big else 300)
            ranges.append((None, 0, n))
            want += bytes(n)
        elif kind < 0.2:
            start = rng.randrange(len(memory))
            n = rng.randint(0, len(memory) - start)
            ranges.append((memory, start, n))
            want += memory[start:start + n]
        else:
            name = rng.choice("ab")
            data = files[name]
            start = rng.randrange(len(data))
            n = rng.randint(0, len(data) - start if big else min(300, len(data) - start))
            ranges.append((name, start, n))
            want += data[start:start + n]
    source = LocalSource(str(tmp_path))
    try:
        assert kernel_copy.crc32(source, ranges) == zlib.crc32(want)
        advanced = []
        with open(tmp_path / "out", "wb") as out:
            out.write(b"head")
            assert kernel_copy.copy(source, ranges, out, advanced.append) == len(want)
        assert (tmp_path / "out").read_bytes() == b"head" + want
        assert sum(advanced) == len(want)
    finally:
        source.close()


def test_a_small_range_past_the_end_of_its_file_is_refused(tmp_path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 100)
    source = LocalSource(str(tmp_path))
    try:
        with pytest.raises(OSError, match="ends before byte 100"):
            kernel_copy.crc32(source, [("a", 90, 20)])
        with open(tmp_path / "out", "wb") as out, pytest.raises(OSError, match="ends before byte 100"):
            kernel_copy.copy(source, [("a", 0, 10), ("a", 90, 20)], out)
    finally:
        source.close()
