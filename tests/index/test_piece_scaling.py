"""Checks over pieces grow as n log n, not n squared, in any layout: one DCP tensor stored as up to
100k chunks tiled along rows, along columns, in 2-D and 3-D blocks and in bands cut differently,
is verified (--deep) and consolidated within a generous time guard, and equals what torch reads;
an overlapping and a gapped variant are refused in one sentence (tests/helpers/hostile.py's contract).

The checkpoints are what torch's FileSystemWriter writes: each chunk a torch.save archive, one
after the other in `__0_0.distcp`, and a `.metadata` that pickles torch's own Metadata classes.
torch.save takes about a millisecond a call, so 100k calls per layout would cost minutes: the
chunks cycle through `PERIOD` distinct archives (neighbours always differ, so a misplaced chunk
shows). That the files are what torch reads is checked by dcp.load on the same builder at a few
hundred chunks (a 100k-chunk dcp.load takes minutes); the guard is a timeout, never a benchmark
(docs/performance.md has the measurement).

Each 100k layout is written once per module (`layouts_100k`). A broken variant of it copies its
chunk archives into a folder of its own and pickles its own `.metadata` (`write_derived`): for a
moved or a doubled chunk these are the bytes `write_chunked` writes for the same boxes; after a
gap, each chunk keeps the value class it had in the layout (neighbours still differ).
"""

from __future__ import annotations

import io
import itertools
import pickle
import uuid
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers.hostile import Scene, check_refused, run_ckptkit

PERIOD = 997  # distinct chunk archives (a prime: rows of a grid do not line up with it)
GUARD_S = 600.0  # far above what a run takes, far below the hours n squared took at 100k


def _grid(shape: tuple[int, ...], block: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    ranges = [range(0, d, b) for d, b in zip(shape, block)]
    return [(offs, tuple(min(b, d - o) for o, b, d in zip(offs, block, shape))) for offs in itertools.product(*ranges)]


def _bands(rows: int, cols: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Row bands, each cut into columns its own width (1 to 7): no product grid."""
    boxes = []
    for r in range(rows):
        width = 1 + r % 7
        boxes += [((r, c), (1, min(width, cols - c))) for c in range(0, cols, width)]
    return boxes


def write_chunked(folder: Path, shape: tuple[int, ...], boxes: list, extra: list = ()) -> torch.Tensor:
    """A one-tensor DCP checkpoint ('w', float32) stored as `boxes` (plus `extra` boxes, for
    overlaps), laid out as torch's FileSystemWriter does; returns the tensor it holds (the last
    chunk written wins where chunks overlap)."""
    return write_chunks(folder, shape, boxes, extra)[0]


def write_chunks(folder: Path, shape: tuple[int, ...], boxes: list, extra: list = ()) -> tuple[torch.Tensor, list]:
    """`write_chunked`, also returning its pieces: (offsets, sizes, position, length) of each chunk
    in the data file, in order."""
    folder.mkdir(parents=True)
    expected = torch.zeros(shape, dtype=torch.float32)
    archives: dict[tuple, tuple[bytes, torch.Tensor]] = {}
    pieces, pos = [], 0
    with open(folder / "__0_0.distcp", "wb") as f:
        for k, (offs, sizes) in enumerate(list(boxes) + list(extra)):
            key = (sizes, k % PERIOD)
            if key not in archives:
                archives[key] = (_archive(_value(sizes, k)), _value(sizes, k))
            data, value = archives[key]
            expected[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] = value
            f.write(data)
            pieces.append((offs, sizes, pos, len(data)))
            pos += len(data)
    _write_metadata(folder, shape, pieces)
    return expected, pieces


def write_derived(base: Path, folder: Path, shape: tuple[int, ...], kept: list, extra: list = ()) -> None:
    """Like `write_chunked(folder, shape, kept, extra)`, but `kept` are pieces of the checkpoint
    `base` ((offsets, sizes, position, length), as `write_chunks` returns them, some perhaps moved or
    left out): their archives are copied from base's data file, in order, instead of written again."""
    folder.mkdir(parents=True)
    source = memoryview((base / "__0_0.distcp").read_bytes())
    pieces, pos = [], 0
    with open(folder / "__0_0.distcp", "wb") as f:
        for offs, sizes, start, length in kept:
            f.write(source[start : start + length])
            pieces.append((offs, sizes, pos, length))
            pos += length
        for k, (offs, sizes) in enumerate(extra, start=len(kept)):
            data = _archive(_value(sizes, k))
            f.write(data)
            pieces.append((offs, sizes, pos, len(data)))
            pos += len(data)
    _write_metadata(folder, shape, pieces)


def _archive(value: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _write_metadata(folder: Path, shape: tuple[int, ...], pieces: list) -> None:
    """`.metadata` as FileSystemWriter pickles it: piece k (offsets, sizes, position, length) is
    the k-th chunk of 'w', stored in `__0_0.distcp`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunks, storage = [], {}
    for k, (offs, sizes, pos, length) in enumerate(pieces):
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes)))
        storage[MetadataIndex("w", torch.Size(offs), k)] = _StorageInfo("__0_0.distcp", pos, length)
    meta = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape), chunks=chunks
            )
        },
        planner_data={"w": ("w",)},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(folder), save_id=str(uuid.uuid4())),
    )
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def _value(sizes: tuple[int, ...], k: int) -> torch.Tensor:
    """Chunk k's values: 1, 2, ... plus 1000 times its class (k modulo PERIOD)."""
    return torch.arange(1, 1 + torch.Size(sizes).numel(), dtype=torch.float32).reshape(sizes) + 1000 * (k % PERIOD)


LAYOUTS_100K = {
    "rows": ((100_000, 4), lambda: _grid((100_000, 4), (1, 4))),
    "columns": ((4, 100_000), lambda: _grid((4, 100_000), (4, 1))),
    "blocks": ((500, 800), lambda: _grid((500, 800), (2, 2))),
    "blocks_3d": ((40, 50, 50), lambda: _grid((40, 50, 50), (1, 1, 1))),
    "bands": ((1000, 350), lambda: _bands(1000, 350)),
    "side_by_side_16k": ((4, 16_000), lambda: _grid((4, 16_000), (4, 1))),
}

LAYOUTS_SMALL = {
    "rows": ((600, 3), lambda: _grid((600, 3), (1, 3))),
    "columns": ((3, 600), lambda: _grid((3, 600), (3, 1))),
    "blocks": ((40, 60), lambda: _grid((40, 60), (2, 2))),
    "blocks_3d": ((6, 10, 10), lambda: _grid((6, 10, 10), (1, 2, 1))),
    "bands": ((60, 35), lambda: _bands(60, 35)),
}


def _consolidated(src: Path, tmp: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    out = tmp / "out.safetensors"
    run = run_ckptkit("consolidate", src, out, timeout=GUARD_S)
    assert run.code == 0 and not run.timed_out, run.detail()
    tensors = load_file(str(out))
    (only,) = tensors.values()
    return only


@pytest.mark.parametrize("layout", sorted(LAYOUTS_SMALL))
def test_the_builder_writes_what_torch_reads_and_ckptkit_reads_the_same(tmp_path, layout):
    """Some hundred chunks (past the sizes where coverage checks pairwise and planning visits
    every piece): torch's dcp.load of the file, the tensor written and consolidate all agree."""
    import torch.distributed.checkpoint as dcp

    shape, boxes = LAYOUTS_SMALL[layout]
    src = tmp_path / "ckpt"
    expected = write_chunked(src, shape, boxes())
    loaded = {"w": torch.full(shape, -1.0)}
    dcp.load(loaded, checkpoint_id=str(src), no_dist=True)
    assert torch.equal(loaded["w"], expected)
    assert torch.equal(_consolidated(src, tmp_path), loaded["w"])
    run = run_ckptkit("verify", "--deep", src, timeout=GUARD_S)
    assert run.code == 0, run.detail()


@pytest.fixture(scope="module")
def layouts_100k(tmp_path_factory) -> Callable[[str], tuple[Path, list]]:
    """A 100k layout's checkpoint and its pieces, written the first time a test asks for it and
    shared by the module's tests (none writes into it: each broken variant is a folder of its own)."""
    built: dict[str, tuple[Path, list]] = {}

    def get(layout: str) -> tuple[Path, list]:
        if layout not in built:
            shape, boxes = LAYOUTS_100K[layout]
            src = tmp_path_factory.mktemp(f"layout_{layout}") / "ckpt"
            built[layout] = (src, write_chunks(src, shape, boxes())[1])
        return built[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["rows", "columns", "blocks"])  # (3-D blocks and bands: at hundreds above)
def test_many_chunks_in_any_layout_are_checked_in_seconds(layouts_100k, layout):
    """100k chunks: every check over the pieces (coverage, overlap, the read plan's lookup) runs
    in `verify`; reading every chunk's bytes is linear work, shown once below."""
    src, _ = layouts_100k(layout)
    run = run_ckptkit("verify", src, timeout=GUARD_S)
    assert run.code == 0 and not run.timed_out, run.detail()


@pytest.mark.slow
def test_one_tensor_of_16k_side_by_side_chunks_verifies_and_consolidates(tmp_path):
    shape, boxes = LAYOUTS_100K["side_by_side_16k"]
    src = tmp_path / "ckpt"
    expected = write_chunked(src, shape, boxes())
    run = run_ckptkit("verify", "--deep", src, timeout=GUARD_S)
    assert run.code == 0 and not run.timed_out, run.detail()
    assert torch.equal(_consolidated(src, tmp_path), expected)


def _moved(boxes: list, shape: tuple[int, ...]) -> tuple[list, list]:
    """A middle chunk shifted by one along its last dimension that has room: an overlap and a gap."""
    k = len(boxes) // 2
    offs, sizes = boxes[k][:2]
    d = max(i for i in range(len(shape)) if offs[i] > 0 or offs[i] + sizes[i] < shape[i])
    delta = -1 if offs[d] > 0 else 1
    moved = list(boxes)
    moved[k] = (offs[:d] + (offs[d] + delta,) + offs[d + 1 :], *boxes[k][1:])
    return moved, []


def _doubled(boxes: list, shape: tuple[int, ...]) -> tuple[list, list]:
    """One more chunk inside one a third of the way in, from its second element along a dimension
    (DCP keys a chunk by its offsets: a second chunk at the same offsets is another question)."""
    k = next(i for i in range(len(boxes) // 3, len(boxes)) if max(boxes[i][1]) > 1)
    offs, sizes = boxes[k][:2]
    d = sizes.index(max(sizes))
    return list(boxes), [(offs[:d] + (offs[d] + 1,) + offs[d + 1 :], sizes[:d] + (sizes[d] - 1,) + sizes[d + 1 :])]


def _gapped(boxes: list, shape: tuple[int, ...]) -> tuple[list, list]:
    return boxes[: len(boxes) // 2] + boxes[len(boxes) // 2 + 1 :], []


BROKEN = {
    "moved": (_moved, "not tiled exactly"),
    "doubled": (_doubled, "stored twice"),
    "gapped": (_gapped, "in no piece"),
}


def _refused(src: Path, tmp_path: Path, breaking: str) -> None:
    _, words = BROKEN[breaking]
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    scene = Scene(src, out)
    check_refused(run_ckptkit("consolidate", src, out, timeout=GUARD_S), "w", words, scene=scene)
    run = run_ckptkit("verify", src, timeout=GUARD_S)
    assert not run.timed_out and run.code != 0 and "Traceback" not in run.output, run.detail()


@pytest.mark.parametrize("breaking", sorted(BROKEN))
@pytest.mark.parametrize("layout", ["columns", "blocks_3d", "bands"])
def test_a_broken_tiling_of_hundreds_of_chunks_is_one_sentence(tmp_path, layout, breaking):
    shape, boxes = LAYOUTS_SMALL[layout]
    kept, extra = BROKEN[breaking][0](boxes(), shape)
    write_chunked(tmp_path / "ckpt", shape, kept, extra)
    _refused(tmp_path / "ckpt", tmp_path, breaking)


@pytest.mark.slow
@pytest.mark.parametrize("layout,breaking", [("rows", "gapped"), ("columns", "moved"), ("blocks", "doubled")])
def test_a_broken_tiling_of_100k_chunks_is_one_sentence_in_seconds(layouts_100k, tmp_path, layout, breaking):
    shape, _ = LAYOUTS_100K[layout]
    base, pieces = layouts_100k(layout)
    kept, extra = BROKEN[breaking][0](pieces, shape)
    write_derived(base, tmp_path / "ckpt", shape, kept, extra)
    _refused(tmp_path / "ckpt", tmp_path, breaking)
