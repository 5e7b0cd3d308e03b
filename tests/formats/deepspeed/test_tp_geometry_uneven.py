"""Uneven tensor-parallel geometry (formats/deepspeed/tp_geometry.py): slices of different lengths
along the split dimension join in rank order and a full tensor splits into given per-rank sizes,
split then join being the identity; the rules file's "sizes" field is parsed and checked."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from ckptkit.convert.tp_rules import TpSplit, load_rules  # noqa: E402
from ckptkit.errors import FormatError, UnsupportedError  # noqa: E402
from ckptkit.formats.deepspeed.tp_geometry import TpGeometry, for_full, for_uneven_slices  # noqa: E402


def _cut(full: torch.Tensor, geometry: TpGeometry, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice through the geometry's flat runs of the full tensor."""
    flat = full.reshape(-1)
    runs = geometry.split("ref", tuple(full.shape), rank)
    values = torch.cat([flat[p.start : p.start + p.length] for p in runs]) if runs else flat[:0]
    return values.reshape(geometry.local_shape(tuple(full.shape), rank))


@pytest.mark.parametrize(
    "shape,dim,sizes", [((37, 5), 0, (19, 18)), ((4, 37), 1, (13, 12, 12)), ((3, 7, 2), 1, (4, 0, 3))]
)
def test_uneven_split_gives_each_rank_its_run_in_rank_order(shape, dim, sizes):
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    geometry = for_full(TpSplit("split", dim), shape, dim, len(sizes), "t", sizes)
    for rank, want in enumerate(full.split(list(sizes), dim=dim)):
        assert torch.equal(_cut(full, geometry, rank), want), rank


def test_uneven_slices_join_with_each_ranks_length():
    split = TpSplit("split", 1, rule="r")
    geometry = for_uneven_slices(split, [(4, 13), (4, 12), (4, 12)], 1, 3, "t", "ckpt")
    assert geometry.shares == ((13, 12, 12),)
    assert geometry.full_shape((4, 13)) == (4, 37)
    assert [b.full_start for r in range(3) for b in geometry.blocks(r)] == [0, 13, 25]


def test_slices_differing_in_another_dimension_are_refused():
    with pytest.raises(UnsupportedError, match="along more than the dimension 0"):
        for_uneven_slices(TpSplit("split", 0, rule="r"), [(5, 3), (4, 2)], 0, 2, "t", "ckpt")


def test_an_uneven_split_of_fused_blocks_is_refused():
    with pytest.raises(UnsupportedError, match="uneven split of fused blocks is not supported"):
        for_uneven_slices(TpSplit("fused", 0, rule="qkv", count=3), [(12, 8), (9, 8)], 0, 2, "t", "ckpt")


def test_rules_file_sizes_are_parsed_and_checked(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"rules": [{"pattern": "*.up_proj.weight", "split": 0, "sizes": [13, 12, 12]}]}))
    assert load_rules(str(good)).find("m.mlp.up_proj.weight").sizes == (13, 12, 12)
    for bad in ({"split": 0, "sizes": [1, -1]}, {"split": 0, "sizes": "3"}, {"fused": 3, "sizes": [1, 2]}):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"rules": [{"pattern": "x", **bad}]}))
        with pytest.raises(FormatError, match="sizes"):
            load_rules(str(path))
