"""The one tensor-parallel split geometry (formats/deepspeed/tp_geometry.py) serves both directions.

On the real tensor-parallel fixtures (fixtures/data/ds_tp/, real DeepSpeed runs at tp 2; the
truth files hold each parameter's full fp32 master and every tp rank's slice of it, as DeepSpeed's
safe_get_full_fp32_param gave them on that rank):

* `split` of the full tensor gives each rank's slice as DeepSpeed holds it, through the writers'
  own path (TpSlicer's rank index, read back by the Fetcher);
* `join` of the ranks' slices, stored as a ZeRO flat range or as a whole module tensor, reads back
  as the full tensor; split then join is the identity at the fixture's tp and at other sizes;
* both agree with DeepSpeed's own geometry (deepspeed/checkpoint/affine.py: `extract` and
  `rebuild` of the map for the same split), and `affine_ranks` is that map's own record
  (`to_dict`), the one AutoTP saves in universal_checkpoint_info.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ckptkit.convert.tp_rules import TpSplit  # noqa: E402
from ckptkit.errors import UsageError  # noqa: E402
from ckptkit.formats.deepspeed.tp_geometry import TpGeometry, TpSlicer, for_full, for_slices  # noqa: E402
from ckptkit.index.types import Box, CheckpointIndex, FlatRange, Location, Piece, TensorEntry  # noqa: E402
from ckptkit.index.virtual import Part  # noqa: E402
from ckptkit.runner.fetch import Fetcher  # noqa: E402
from ckptkit.storage.source import LocalSource  # noqa: E402

DATA = Path(__file__).resolve().parents[3] / "fixtures" / "data" / "ds_tp"
VERSIONS = json.loads((DATA / "VERSIONS.json").read_text()) if (DATA / "VERSIONS.json").exists() else {}
FIXTURES = sorted(VERSIONS.get("fixtures", {}))
pytestmark = pytest.mark.skipif(
    not FIXTURES, reason="fixtures/data/ds_tp/ not generated (python fixtures/generate_ds_tp.py)"
)


def _truth(name: str) -> dict:
    return torch.load(DATA / f"{name}.truth.pt", weights_only=True)


def _opened(name: str):
    from ckptkit.formats.registry import open_checkpoint

    return open_checkpoint(str(DATA / name))


def _params(truth: dict) -> list[str]:
    return [k[len("split.") :] for k in truth if k.startswith("split.")]


def _rule_split(recorded: tuple) -> TpSplit:
    """The fixture's own record of a parameter's split as a TpSplit."""
    if recorded[0] == "replicated":
        return TpSplit("replicated", None)
    if recorded[0] == "fused":
        return TpSplit("fused", recorded[1], count=recorded[2])
    return TpSplit("split", recorded[1])


def _apply(parts: list[Part], full: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor `parts` (flat runs of `full`) make up, in shape `shape`."""
    flat = full.reshape(-1)
    return torch.cat([flat[p.start : p.start + p.length] for p in parts]).reshape(shape)


def _joined(tmp_path: Path, geometry: TpGeometry, slices: list[torch.Tensor], flat: bool) -> torch.Tensor:
    """The full tensor read back from `geometry.join` over the slices stored in files: each as one
    whole tensor (a module weight) or as two flat ranges (a ZeRO partition cut mid-slice)."""
    entries = []
    for rank, piece in enumerate(slices):
        data = piece.contiguous().view(torch.uint8).numpy().tobytes()
        (tmp_path / f"rank{rank}.bin").write_bytes(data)
        n, item = piece.numel(), piece.element_size()
        if flat and n > 1:
            cut = n // 2 + 1
            pieces = [
                Piece(FlatRange(0, cut), Location(f"rank{rank}.bin", 0, cut * item)),
                Piece(FlatRange(cut, n - cut), Location(f"rank{rank}.bin", cut * item, (n - cut) * item)),
            ]
        else:
            pieces = [Piece(Box.whole(tuple(piece.shape)), Location(f"rank{rank}.bin", 0, n * item))]
        entries.append(TensorEntry("t", "float32", tuple(piece.shape), pieces))
    shape = geometry.full_shape(tuple(slices[0].shape))
    index = CheckpointIndex(format="test", root=str(tmp_path), world_size=geometry.tp)
    full = TensorEntry("t", "float32", shape, geometry.join(entries))
    index.add_tensor(full)
    return Fetcher(LocalSource(str(tmp_path)), index=index).fetch(full)


def _deepspeed_map(geometry: TpGeometry, shape: tuple[int, ...]):
    """DeepSpeed's own affine map of the same split (deepspeed/checkpoint/affine.py)."""
    affine = pytest.importorskip("deepspeed.checkpoint.affine")
    if geometry.dim is None:
        return affine.replicated_map(shape, geometry.tp)
    if len(geometry.parts) == 1:
        return affine.contiguous_split_map(shape, [shape[geometry.dim] // geometry.tp] * geometry.tp, geometry.dim)
    widths = [[p // geometry.tp] * geometry.tp for p in geometry.parts]
    return affine.sub_param_map(shape, list(geometry.parts), widths, geometry.dim)


@pytest.mark.parametrize("name", FIXTURES)
def test_split_gives_each_rank_the_slice_deepspeed_holds(name):
    opened = _opened(name)
    index, truth = opened.index, _truth(name)
    tp = index.native.tp
    slicer = TpSlicer(index, index.native.splits, tp)
    rank_indexes = [slicer.rank_index(t, 1) for t in range(tp)]
    checked = 0
    for param in _params(truth):
        key = f"model.{param}"
        geometry = slicer.geometry(index.tensors[key])
        full = truth[f"fp32.{param}"]
        for t in range(tp):
            want = truth[f"slice.tp{t}.fp32.{param}"]
            entry = rank_indexes[t].tensors[key]
            got = Fetcher(opened.source, index=rank_indexes[t]).fetch(entry)
            assert tuple(got.shape) == tuple(want.shape) == geometry.local_shape(tuple(full.shape)), (key, t)
            assert torch.equal(got, want), (key, t)
            checked += 1
    assert checked >= 2 * len(_params(truth))


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("flat", [True, False], ids=["zero-flat-ranges", "whole-module-tensors"])
def test_join_of_deepspeeds_slices_is_the_full_tensor(tmp_path, name, flat):
    truth = _truth(name)
    tp = VERSIONS["tp"]
    for param in _params(truth):
        slices = [truth[f"slice.tp{t}.fp32.{param}"] for t in range(tp)]
        split = _rule_split(truth[f"split.{param}"])
        if split.kind == "replicated":
            geometry = TpGeometry(tp, None)
        else:
            geometry = for_slices(split, tuple(slices[0].shape), split.dim, tp, param)
        folder = tmp_path / param
        folder.mkdir()
        got = _joined(folder, geometry, slices, flat)
        assert torch.equal(got, truth[f"fp32.{param}"]), param


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_then_join_is_the_identity_and_matches_deepspeeds_affine_map(tmp_path, name, tp):
    truth = _truth(name)
    tried = 0
    for param in _params(truth):
        full = truth[f"fp32.{param}"]
        shape = tuple(full.shape)
        split = _rule_split(truth[f"split.{param}"])
        try:
            geometry = for_full(split, shape, split.dim, tp, param)
        except UsageError:  # a size tp cannot share equally (refusal tested below)
            assert split.dim is not None and any(p % tp for p in _parts_of(split, shape))
            continue
        slices = [_apply(geometry.split("t", shape, t), full, geometry.local_shape(shape)) for t in range(tp)]
        ds_map = _deepspeed_map(geometry, shape)
        for t in range(tp):
            assert torch.equal(slices[t], ds_map.extract(full, t)), (param, t)
        assert torch.equal(ds_map.rebuild(dict(enumerate(slices))), full), param
        folder = tmp_path / param
        folder.mkdir()
        assert torch.equal(_joined(folder, geometry, slices, flat=True), full), param
        tried += 1
    assert tried >= len(_params(truth)) // 2


def _parts_of(split: TpSplit, shape: tuple[int, ...]) -> list[int]:
    length = shape[split.dim]
    if split.kind == "fused":
        return [length // split.blocks] * split.blocks
    return [length]


def test_fused_blocks_give_each_rank_its_share_of_every_block():
    geometry = TpGeometry(2, 0, (4, 2, 2))
    assert [(b.local_start, b.local_size, b.full_start) for b in geometry.blocks(1)] == [
        (0, 2, 2),
        (2, 1, 5),
        (3, 1, 7),
    ]
    assert geometry.split("t", (8, 3), 1) == [Part("t", 6, 6), Part("t", 15, 3), Part("t", 21, 3)]
    assert geometry.local_shape((8, 3)) == (4, 3) and geometry.full_shape((4, 3)) == (8, 3)


def test_split_refuses_sizes_the_ranks_cannot_share():
    with pytest.raises(UsageError, match=r"--to tp=3: 'w' is split along dim 0 with its size 8"):
        for_full(TpSplit("split", 0), (8, 2), 0, 3, "w")
    with pytest.raises(UsageError, match=r"fused parts \[4, 4\]"):
        for_full(TpSplit("fused", 0, count=2), (8, 2), 0, 8, "w")


def test_a_replicated_tensor_is_whole_on_every_rank():
    geometry = for_full(None, (3, 5), None, 4, "ln")
    assert geometry.split("ln", (3, 5), 3) == [Part("ln", 0, 15)]
    assert geometry.local_shape((3, 5)) == (3, 5) and math.prod(geometry.local_shape((3, 5))) == 15


@pytest.mark.parametrize(
    "geometry,shape",
    [
        (TpGeometry(2, 0, (8,)), (8, 6)),
        (TpGeometry(3, 1, (6,)), (4, 6)),
        (TpGeometry(2, 2, (4,)), (2, 3, 4)),
        (TpGeometry(4, None), (8, 6)),
    ],
    ids=["rows", "columns", "last-of-three", "replicated"],
)
def test_affine_ranks_are_deepspeeds_own_affine_map(geometry, shape):
    want = _deepspeed_map(geometry, shape).to_dict()
    assert want == {"logical_shape": list(shape), "ranks": geometry.affine_ranks(shape)}
