"""storage/kernel_copy with many small ranges (a ZeRO partition's slices): small ranges are read
with one pread each and written together, large ones copied in the kernel; the bytes written and
the CRC32 must be those of the ranges concatenated, in order, whatever the mix."""

from __future__ import annotations

import random
import tempfile
import zlib

import pytest

from ckptkit.errors import FormatError
from ckptkit.storage import kernel_copy
from ckptkit.storage.source import LocalSource


def _crc(source: LocalSource, ranges: list) -> int:
    """The CRC32 the writers get for these ranges: copy_with_crc's (written to a scratch file)."""
    with tempfile.TemporaryFile() as out:
        return kernel_copy.copy_with_crc(source, ranges, out)[1]


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
            want += memory[start : start + n]
        else:
            name = rng.choice("ab")
            data = files[name]
            start = rng.randrange(len(data))
            n = rng.randint(0, len(data) - start if big else min(300, len(data) - start))
            ranges.append((name, start, n))
            want += data[start : start + n]
    source = LocalSource(str(tmp_path))
    try:
        assert _crc(source, ranges) == zlib.crc32(want)
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
            _crc(source, [("a", 90, 20)])
        with open(tmp_path / "out", "wb") as out, pytest.raises(OSError, match="ends before byte 100"):
            kernel_copy.copy(source, [("a", 0, 10), ("a", 90, 20)], out)
    finally:
        source.close()


def _neighbour_ranges(rng: random.Random, files: dict[str, bytes], count: int) -> tuple[list, bytes]:
    """Ranges the way a reshard asks for them: small slices that mostly follow each other in
    their file with small gaps, interleaved across files, now and then stepping back, jumping
    far ahead or overlapping the previous one."""
    at = {name: 0 for name in files}
    ranges, want = [], bytearray()
    for _ in range(count):
        name = rng.choice(sorted(files))
        data = files[name]
        step = rng.random()
        if step < 0.05:
            start = rng.randrange(len(data))  # anywhere: back, or far ahead
        elif step < 0.15:
            start = max(0, at[name] - rng.randint(1, 200))  # overlapping the last one
        else:
            start = at[name] + rng.choice([0, 0, 8, 40, 4000, 5000])
        start = min(start, len(data))
        n = min(rng.choice([0, 1, 88, 256, 3000]), len(data) - start)
        ranges.append((name, start, n))
        want += data[start : start + n]
        at[name] = start + n
    return ranges, bytes(want)


@pytest.mark.parametrize("seed", range(8))
def test_neighbouring_ranges_read_in_blocks_are_the_ranges_concatenated(tmp_path, seed: int) -> None:
    rng = random.Random(100 + seed)
    files = {f"f{k}": rng.randbytes(rng.choice([50, 40_000, 3 << 20])) for k in range(rng.choice([2, 3, 20]))}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    ranges, want = _neighbour_ranges(rng, files, rng.randint(1, 3000))
    source = LocalSource(str(tmp_path))
    try:
        assert _crc(source, ranges) == zlib.crc32(want)
        assert kernel_copy.read(source, ranges) == want
        with open(tmp_path / "out", "wb") as out:
            out.write(b"head")
            assert kernel_copy.copy_with_crc(source, ranges, out) == (len(want), zlib.crc32(want))
        assert (tmp_path / "out").read_bytes() == b"head" + want
    finally:
        source.close()


def test_a_partitions_slices_are_read_a_block_at_a_time(tmp_path, monkeypatch) -> None:
    """10k slices of 88 bytes, 40 bytes apart, alternating between two ranks' files (a ZeRO-3
    partition resharded 2 -> 3): a few block reads, not a read per slice; bytes unchanged."""
    rng = random.Random(7)
    files = {"r0": rng.randbytes(1 << 20), "r1": rng.randbytes(1 << 20)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    ranges = [(f"r{i % 2}", (i // 2) * 128, 88) for i in range(10_000)]
    want = b"".join(files[rel][at : at + n] for rel, at, n in ranges)
    reads: list[int] = []
    real = kernel_copy.pread_block
    monkeypatch.setattr(kernel_copy, "pread_block", lambda *a: reads.append(a[3]) or real(*a))
    source = LocalSource(str(tmp_path))
    try:
        with open(tmp_path / "out", "wb") as out:
            assert kernel_copy.copy_with_crc(source, ranges, out) == (len(want), zlib.crc32(want))
        assert (tmp_path / "out").read_bytes() == want
    finally:
        source.close()
    assert len(reads) == 2  # each file's 5000 slices span 640 KB: one block each
    assert sum(reads) == 2 * (4999 * 128 + 88)  # the gaps between slices, never past the last one


def test_a_block_past_the_end_of_its_file_names_the_file_and_byte(tmp_path) -> None:
    """The last range runs past the end: the block that holds it says where the file ends, and
    how many of that range's bytes are missing, as a read of the range alone would."""
    (tmp_path / "a").write_bytes(b"x" * 100)
    ranges = [("a", 0, 10), ("a", 40, 20), ("a", 95, 10)]
    source = LocalSource(str(tmp_path))
    try:
        with pytest.raises(OSError, match="a: ends before byte 100"):
            _crc(source, ranges)
        with pytest.raises(FormatError, match="a: file ends at byte 100, expected 5 more bytes"):
            kernel_copy.read(source, ranges)
    finally:
        source.close()
