"""diff compares numpy arrays held in a checkpoint's values (an RNG state, client state) as data:
same dtype, shape and bits is equal, anything else is a difference; never numpy's elementwise ==."""

from __future__ import annotations

import json

import numpy
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from ckptkit.ops.diff import diff
from ckptkit_cli.main import cli


def _rng_like(seed: int) -> dict:
    """What an RNG state looks like saved by a training loop: numpy's state tuple, nested."""
    state = numpy.random.RandomState(seed).get_state()
    return {"np_rng_state": state, "weights": [numpy.arange(4, dtype=numpy.float32) * seed], "n": numpy.int64(seed)}


def _save(path, rng: dict) -> str:
    torch.manual_seed(0)
    dcp.save({"model": {"w": torch.randn(3, 2)}, "rng_state": [rng]}, checkpoint_id=str(path), no_dist=True)
    return str(path)


def test_numpy_values_compare_equal_to_themselves(tmp_path):
    a = _save(tmp_path / "a", _rng_like(1))
    b = _save(tmp_path / "b", _rng_like(1))
    result = diff(a, b)
    assert result.equal
    assert any(r.name.startswith("extra:rng_state") and r.status == "equal" for r in result.rows)
    run = CliRunner().invoke(cli, ["diff", a, a])
    assert run.exit_code == 0, run.output
    assert "\nequal\n" in run.output


def test_numpy_values_that_differ_are_a_difference(tmp_path):
    a = _save(tmp_path / "a", _rng_like(1))
    b = _save(tmp_path / "b", _rng_like(2))
    result = diff(a, b)
    assert not result.equal
    rows = [r for r in result.rows if r.name.startswith("extra:rng_state")]
    assert rows and all(r.status == "different" for r in rows)
    state = next(r for r in rows if r.name == "extra:rng_state.0.np_rng_state")
    assert "array(" in state.detail  # shown as numpy shows it
    run = CliRunner().invoke(cli, ["diff", a, b, "--json"])
    assert run.exit_code == 1, run.output
    assert not json.loads(run.output)["equal"]


def test_arrays_of_other_dtype_or_shape_are_a_difference(tmp_path):
    ones = {"x": numpy.ones(4, dtype=numpy.float32)}
    a = _save(tmp_path / "a", ones)
    b = _save(tmp_path / "b", {"x": numpy.ones(4, dtype=numpy.float64)})
    c = _save(tmp_path / "c", {"x": numpy.ones((2, 2), dtype=numpy.float32)})
    assert not diff(a, b).equal
    assert not diff(a, c).equal
    assert diff(a, _save(tmp_path / "d", {"x": numpy.ones(4, dtype=numpy.float32)})).equal
