"""diff and NaN: a NaN against a number is a counted mismatch (not an infinite difference) at any
tolerance, NaNs of the same bits in the same place are equal, NaNs of other bits are not bit-equal,
the same infinity is no difference; the CLI shows NaN mismatches and --json carries them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.corrupt import run_cli


def _two(
    tmp_path: Path, a: list[float], b: list[float], dtype: str = "float32", bits_b: list[int] | None = None
) -> tuple[str, str]:
    import torch
    from safetensors.torch import save_file

    ta = torch.tensor(a, dtype=getattr(torch, dtype))
    tb = torch.tensor(b, dtype=getattr(torch, dtype))
    if bits_b is not None:  # raw bit patterns (NaN payloads)
        tb = torch.tensor(bits_b, dtype=torch.int32).view(torch.float32)
    save_file({"w": ta}, str(tmp_path / "a.safetensors"))
    save_file({"w": tb}, str(tmp_path / "b.safetensors"))
    return str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")


def _row(a: str, b: str, **kw):
    from ckptkit.ops.diff import diff

    return next(r for r in diff(a, b, **kw).rows if r.name == "w")


def test_nan_against_a_number_is_counted_not_called_inf(tmp_path):
    nan = float("nan")
    row = _row(*_two(tmp_path, [1.0, nan, 3.0, nan], [1.5, 2.0, 3.0, nan]))
    assert row.status == "different"
    assert row.nan_mismatches == 1
    assert row.max_abs_diff == pytest.approx(0.5)  # over the positions both sides can compare
    assert "1 position NaN on one side only" in row.detail, row.detail


def test_nan_mismatch_is_a_difference_whatever_the_tolerance(tmp_path):
    nan = float("nan")
    row = _row(*_two(tmp_path, [1.0, nan], [1.0, 2.0]), atol=1e9)
    assert row.status == "different" and row.nan_mismatches == 1 and row.max_abs_diff == 0.0


def test_nan_in_the_same_place_with_the_same_bits_is_equal(tmp_path):
    nan = float("nan")
    row = _row(*_two(tmp_path, [1.0, nan], [1.0, nan]))
    assert row.status == "equal" and row.nan_mismatches == 0


def test_nans_of_different_bits_are_not_bit_equal(tmp_path):
    """Bitwise equality is the first criterion: two NaNs of other payloads are close, not equal."""
    import struct

    one = struct.unpack("<i", struct.pack("<f", 1.0))[0]
    row = _row(*_two(tmp_path, [1.0, float("nan")], [], bits_b=[one, 0x7FC00001]))
    assert row.status == "close" and row.nan_mismatches == 0 and row.max_abs_diff == 0.0
    assert "NaN" in row.detail and "bits" in row.detail


def test_the_same_infinity_is_no_difference(tmp_path):
    inf = float("inf")
    row = _row(*_two(tmp_path, [inf, -inf, 1.0], [inf, -inf, 2.0]))
    assert row.status == "different" and row.max_abs_diff == pytest.approx(1.0)
    row = _row(*_two(tmp_path, [inf, 1.0], [-inf, 1.0]))
    assert row.max_abs_diff == float("inf")


def test_cli_shows_and_json_carries_nan_mismatches(tmp_path):
    nan = float("nan")
    a, b = _two(tmp_path, [nan, 1.0], [2.0, 1.0])
    res = run_cli("diff", a, b)
    assert res.code == 1
    line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("different"))
    assert "NaN on one side only" in line and " inf" not in line, line
    res = run_cli("diff", "--json", a, b)
    row = next(r for r in json.loads(res.stdout)["rows"] if r["name"] == "w")
    assert row["nan_mismatches"] == 1 and row["max_abs_diff"] == 0.0
    res = run_cli("diff", "--stat", a, b)
    assert "w" in res.stdout.split("largest changes")[1]
