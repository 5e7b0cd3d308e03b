"""Fetcher against ground truth: pieces written as raw bytes to real files, read back by box.

A random tensor (random bits, so NaN payloads and every bit pattern must survive) is split into
pieces by a random layout. Each piece's bytes go into a file at a nonzero offset with junk bytes
around them: box pieces either contiguous or stored with a permuted, padded element stride
(``Location.stride``), flat pieces as their row-major flat range. ``Fetcher.fetch`` of any box
must equal the truth slice bit for bit, and must only read inside the pieces' byte spans.
"""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckptkit.errors import CkptkitError, FormatError
from ckptkit.index.dtypes import torch_dtype
from ckptkit.index.layouts import chunk_dim0
from ckptkit.index.types import Box, FlatRange, Location, Piece, TensorEntry
from ckptkit.runner.fetch import Fetcher
from ckptkit.storage.source import LocalSource

DTYPES = ["float32", "bfloat16", "int64", "bool", "float16"]
KEY = "model.layers.3.mlp.weight"

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


# ---------------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype)  # fresh, standard strides
    flat.copy_(t.reshape(-1))
    return flat.view(torch.uint8)


def to_bytes(t: torch.Tensor) -> bytes:
    return bits(t).numpy().tobytes()


def from_bytes(raw: bytes, td: torch.dtype) -> torch.Tensor:
    if not raw:
        return torch.empty(0, dtype=td)
    return torch.frombuffer(bytearray(raw), dtype=td)


def random_tensor(dtype: str, shape, rng: np.random.Generator) -> torch.Tensor:
    td = torch_dtype(dtype)
    n = math.prod(shape)
    if dtype == "bool":
        raw = rng.integers(0, 2, n, dtype=np.uint8)
    else:
        raw = rng.integers(0, 256, n * td.itemsize, dtype=np.uint8)
    return from_bytes(raw.tobytes(), td).reshape(shape)


def idx(box: Box):
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


class Files:
    """Builds files of junk with payloads at recorded offsets."""

    def __init__(self, root: str, rng: np.random.Generator) -> None:
        self.root, self.rng = root, rng
        self.data: dict[str, bytearray] = {}

    def _junk(self, lo=1, hi=40) -> bytes:
        return self.rng.integers(0, 256, int(self.rng.integers(lo, hi)), dtype=np.uint8).tobytes()

    def add(self, rel: str, payload: bytes) -> int:
        buf = self.data.setdefault(rel, bytearray())
        buf += self._junk()
        off = len(buf)
        buf += payload
        return off

    def write(self) -> None:
        for rel, buf in self.data.items():
            path = os.path.join(self.root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(bytes(buf) + self._junk())


def strided_storage(piece: torch.Tensor, perm, pad, rng):
    """Store `piece` with its dims permuted by `perm` inside a padded buffer.

    Returns (bytes of the whole buffer, element stride of the piece's logical dims)."""
    td = piece.dtype
    stored_sizes = [piece.shape[p] + pad[i] for i, p in enumerate(perm)]
    n = math.prod(stored_sizes)
    storage = from_bytes(rng.integers(0, 256, n * td.itemsize, dtype=np.uint8).tobytes(), td)
    storage = storage.reshape(stored_sizes)
    if td == torch.bool:  # keep padding valid booleans (never read, but be tidy)
        storage.view(torch.uint8).bitwise_and_(1)
    window = storage[tuple(slice(0, piece.shape[p]) for p in perm)]
    window.copy_(piece.permute(*perm))
    inv = [perm.index(d) for d in range(len(perm))]
    logical = window.permute(*inv)
    assert logical.shape == piece.shape and torch.equal(bits(logical), bits(piece))
    return to_bytes(storage), tuple(logical.stride())


@st.composite
def guillotine(draw, shape, max_splits=8):
    boxes = [Box.whole(shape)]
    for _ in range(draw(st.integers(0, max_splits))):
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        dims = [d for d in range(b.ndim) if b.sizes[d] >= 2]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        c = draw(st.integers(1, b.sizes[d] - 1))
        boxes[i : i + 1] = [
            Box(b.offsets, b.sizes[:d] + (c,) + b.sizes[d + 1 :]),
            Box(
                b.offsets[:d] + (b.offsets[d] + c,) + b.offsets[d + 1 :],
                b.sizes[:d] + (b.sizes[d] - c,) + b.sizes[d + 1 :],
            ),
        ]
    return boxes


@st.composite
def box_in(draw, shape):
    offs, sizes = [], []
    for d in shape:
        o = draw(st.integers(0, d))
        offs.append(o)
        sizes.append(draw(st.integers(0, d - o)))
    return Box(tuple(offs), tuple(sizes))


@st.composite
def regions_for(draw, shape):
    kind = draw(st.sampled_from(["box", "chunk", "flat"]))
    if kind == "chunk" and shape:
        return list(chunk_dim0(shape, draw(st.integers(1, 6))))
    if kind == "flat":
        numel = math.prod(shape)
        cuts = sorted(draw(st.lists(st.integers(0, numel), max_size=6)))
        bounds = [0] + cuts + [numel]
        return [FlatRange(a, b - a) for a, b in zip(bounds, bounds[1:])]
    return draw(guillotine(shape))


def build_entry(draw, root, dtype, shape, truth, regions, rng) -> TensorEntry:
    files = Files(root, rng)
    pieces = []
    order = draw(st.permutations(range(len(regions))))  # file order differs from piece order
    located = {}
    for i in order:
        region = regions[i]
        rel = draw(st.sampled_from(["rank0.bin", "sub/rank1.distcp"]))
        if isinstance(region, FlatRange):
            event("flat piece")
            payload = to_bytes(truth.reshape(-1)[region.start : region.end])
            located[i] = Location(rel, files.add(rel, payload), len(payload))
            continue
        part = truth[idx(region)]
        if region.ndim and region.numel and draw(st.booleans()):
            perm = list(draw(st.permutations(range(region.ndim))))
            pad = [draw(st.integers(0, 2)) for _ in range(region.ndim)]
            payload, stride = strided_storage(part, perm, pad, rng)
            event("strided box piece")
            located[i] = Location(rel, files.add(rel, payload), len(payload), stride=stride)
        else:
            event("contiguous box piece")
            payload = to_bytes(part)
            located[i] = Location(rel, files.add(rel, payload), len(payload))
    files.write()
    for i, region in enumerate(regions):
        pieces.append(Piece(region, located[i]))
    return TensorEntry(KEY, dtype, tuple(shape), pieces)


class RecordingSource(LocalSource):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int, int]] = []

    def readinto(self, rel, offset, buf):
        self.reads.append((rel, offset, len(buf)))
        super().readinto(rel, offset, buf)


def assert_reads_inside_pieces(src: RecordingSource, entry: TensorEntry) -> None:
    for rel, off, n in src.reads:
        assert any(
            p.location.file == rel and p.location.offset <= off and off + n <= p.location.offset + p.location.length
            for p in entry.pieces
        ), f"read {rel}@{off}+{n} outside every piece"


# ---------------------------------------------------------------------------------------------
# properties


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(st.sampled_from(DTYPES), shapes, st.integers(0, 2**32 - 1), st.data())
def test_fetch_matches_truth(tmp_path, dtype, shape, seed, data):
    rng = np.random.default_rng(seed)
    truth = random_tensor(dtype, shape, rng)
    regions = data.draw(regions_for(shape))
    with tempfile.TemporaryDirectory(dir=tmp_path) as root:
        entry = build_entry(data.draw, root, dtype, shape, truth, regions, rng)
        src = RecordingSource(root)
        try:
            fetcher = Fetcher(src)
            boxes = [None] + [data.draw(box_in(shape)) for _ in range(data.draw(st.integers(1, 5)))]
            for box in boxes:
                want = truth if box is None else truth[idx(box)]
                if box is not None and data.draw(st.booleans()):
                    out = torch.full(box.sizes, 0, dtype=truth.dtype)
                    got = fetcher.fetch(entry, box, out=out)
                    assert got.data_ptr() == out.data_ptr()
                else:
                    got = fetcher.fetch(entry, box)
                assert got.dtype == truth.dtype
                assert tuple(got.shape) == tuple(want.shape)
                assert got.is_contiguous()
                assert torch.equal(bits(got), bits(want)), (box, regions)
            assert_reads_inside_pieces(src, entry)
        finally:
            src.close()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
    st.integers(0, 2**32 - 1),
    st.data(),
)
def test_fetch_missing_piece_raises(tmp_path, dtype, shape, seed, data):
    rng = np.random.default_rng(seed)
    truth = random_tensor(dtype, shape, rng)
    regions = data.draw(regions_for(shape))
    with tempfile.TemporaryDirectory(dir=tmp_path) as root:
        entry = build_entry(data.draw, root, dtype, shape, truth, regions, rng)
        nonempty = [i for i, p in enumerate(entry.pieces) if p.numel]
        drop = data.draw(st.sampled_from(nonempty))
        dropped = entry.pieces.pop(drop)
        src = LocalSource(root)
        try:
            with pytest.raises(FormatError, match=KEY.replace(".", r"\.")):
                Fetcher(src).fetch(entry)
            # a tensor missing a piece is refused for every box, covered or not, so no writer
            # can ever emit part of a tensor whose source is incomplete
            box = data.draw(box_in(shape))
            with pytest.raises(CkptkitError, match="not tiled exactly"):
                Fetcher(src).fetch(entry, box)
        finally:
            src.close()
        assert dropped.numel


def _single_piece_file(tmp_path, dtype="float32", shape=(3, 4)):
    rng = np.random.default_rng(0)
    truth = random_tensor(dtype, shape, rng)
    payload = to_bytes(truth)
    junk = b"\xab" * 13
    (tmp_path / "data.bin").write_bytes(junk + payload + junk)
    return truth, payload, len(junk)


def test_fetch_simple_roundtrip(tmp_path):
    truth, payload, off = _single_piece_file(tmp_path)
    entry = TensorEntry(KEY, "float32", (3, 4), [Piece(Box((0, 0), (3, 4)), Location("data.bin", off, len(payload)))])
    src = LocalSource(str(tmp_path))
    try:
        assert torch.equal(bits(Fetcher(src).fetch(entry)), bits(truth))
        got = Fetcher(src).fetch(entry, Box((1, 1), (2, 2)))
        assert torch.equal(bits(got), bits(truth[1:3, 1:3]))
    finally:
        src.close()


def test_fetch_location_past_end_of_file_raises(tmp_path):
    truth, payload, off = _single_piece_file(tmp_path)
    size = (tmp_path / "data.bin").stat().st_size
    src = LocalSource(str(tmp_path))
    try:
        for loc in [
            Location("data.bin", size + 10, len(payload)),  # starts past the end
            Location("data.bin", size - 8, len(payload)),
        ]:  # runs past the end
            entry = TensorEntry(KEY, "float32", (3, 4), [Piece(Box((0, 0), (3, 4)), loc)])
            with pytest.raises(FormatError, match="truncated"):
                Fetcher(src).fetch(entry)
            flat = TensorEntry(KEY, "float32", (3, 4), [Piece(FlatRange(0, 12), loc)])
            with pytest.raises(FormatError, match="truncated"):
                Fetcher(src).fetch(flat)
    finally:
        src.close()


def test_fetch_truncated_file_raises(tmp_path):
    truth, payload, off = _single_piece_file(tmp_path)
    (tmp_path / "data.bin").write_bytes(b"\0" * off + payload[: len(payload) // 2])
    entry = TensorEntry(KEY, "float32", (3, 4), [Piece(Box((0, 0), (3, 4)), Location("data.bin", off, len(payload)))])
    src = LocalSource(str(tmp_path))
    try:
        with pytest.raises(FormatError, match="truncated"):
            Fetcher(src).fetch(entry)
        # the first rows are still there
        got = Fetcher(src).fetch(entry, Box((0, 0), (1, 4)))
        assert torch.equal(bits(got), bits(truth[:1]))
    finally:
        src.close()


def test_fetch_read_past_recorded_length_raises(tmp_path):
    truth, payload, off = _single_piece_file(tmp_path)
    entry = TensorEntry(
        KEY, "float32", (3, 4), [Piece(Box((0, 0), (3, 4)), Location("data.bin", off, len(payload) - 4))]
    )
    src = LocalSource(str(tmp_path))
    try:
        with pytest.raises(FormatError, match=KEY.replace(".", r"\.")):
            Fetcher(src).fetch(entry)
    finally:
        src.close()


def test_fetch_missing_file_raises(tmp_path):
    entry = TensorEntry(KEY, "float32", (2,), [Piece(Box((0,), (2,)), Location("nope.bin", 0, 8))])
    src = LocalSource(str(tmp_path))
    with pytest.raises(FormatError):
        Fetcher(src).fetch(entry)


def test_fetch_no_pieces_names_key(tmp_path):
    entry = TensorEntry(KEY, "bfloat16", (2, 2), [])
    with pytest.raises(FormatError, match=KEY.replace(".", r"\.")) as info:
        Fetcher(LocalSource(str(tmp_path))).fetch(entry)
    assert isinstance(info.value, CkptkitError)
