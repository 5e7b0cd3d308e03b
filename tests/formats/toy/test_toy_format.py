"""A format added through the registry alone: numpy's .npy files, as a tiny format package
(tests/helpers/npy_format: reader.py and its adapter in format.py) registered once with
`registry.register`. Nothing else in ckptkit is told about it, yet the registry's one loop detects
and opens it, `ckptkit inspect` and `ckptkit verify` read it, `ckptkit.load` fills a state dict
from it, and its writer is found by name. The values are checked against numpy.load's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckptkit
import cli.main as cli_main
from ckptkit.context import RunContext
from ckptkit.errors import NotACheckpointError, UnsupportedError
from ckptkit.formats import registry
from ckptkit.runner.fetch import Fetcher
from ckptkit.storage.output import open_output
from ckptkit.storage.source import open_source
from helpers.npy_format.format import NPY, NpyTarget

WEIGHT = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
BIAS = np.array([5, -3, 11], dtype=np.int64)


@pytest.fixture
def npy_folder(tmp_path):
    folder = tmp_path / "npy_ckpt"
    folder.mkdir()
    np.save(folder / "model.weight.npy", WEIGHT)
    np.save(folder / "model.bias.npy", BIAS)
    return folder


@pytest.fixture
def registered(monkeypatch):
    """NPY registered for this test only (the registry's lists restored after it)."""
    monkeypatch.setattr(registry, "FORMATS", registry.FORMATS)
    monkeypatch.setattr(registry, "ORDER", list(registry.ORDER))
    registry.register(NPY)


def test_an_unregistered_format_is_refused(npy_folder):
    assert registry.detect(open_source(str(npy_folder))) == []
    with pytest.raises(NotACheckpointError, match="not a checkpoint ckptkit recognises"):
        registry.open_checkpoint(str(npy_folder))


def test_registering_puts_it_last_in_the_one_list(registered):
    assert registry.FORMATS[-1] is NPY and registry.format_named("npy") is NPY
    assert registry.ORDER[-1].format == "npy"
    with pytest.raises(UnsupportedError, match="already registered"):
        registry.register(NPY)


def test_the_registry_loop_detects_a_folder_and_a_file(registered, npy_folder):
    assert registry.detect(open_source(str(npy_folder))) == ["npy"]
    one = open_source(str(npy_folder), only="model.bias.npy")
    assert registry.detect(one, "model.bias.npy") == ["npy"]


def test_inspect_reads_it_through_the_registry(registered, npy_folder):
    res = CliRunner().invoke(cli_main.cli, ["--quiet", "inspect", "--json", str(npy_folder)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["format"] == "npy"
    shapes = {t["key"]: (t["dtype"], t["shape"]) for t in doc["tensors"]}
    assert shapes == {"model.weight": ("float32", [3, 4]), "model.bias": ("int64", [3])}


def test_verify_deep_reads_every_tensor(registered, npy_folder):
    res = CliRunner().invoke(cli_main.cli, ["--quiet", "verify", "--deep", str(npy_folder)])
    assert res.exit_code == 0, res.output


def test_a_damaged_file_is_refused_in_one_sentence(registered, npy_folder):
    (npy_folder / "model.bias.npy").write_bytes(np.lib.format.MAGIC_PREFIX + b"\x01\x00garbage")
    res = CliRunner().invoke(cli_main.cli, ["--quiet", "inspect", str(npy_folder / "model.bias.npy")])
    assert res.exit_code == 2
    assert "model.bias.npy" in res.output and "Traceback" not in res.output


def test_ckptkit_load_fills_a_state_dict_with_numpys_values(registered, npy_folder):
    state = {"model": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3, dtype=torch.int64)}}
    ckptkit.load(state, str(npy_folder))
    assert np.array_equal(state["model"]["weight"].numpy(), np.load(npy_folder / "model.weight.npy"))
    assert np.array_equal(state["model"]["bias"].numpy(), np.load(npy_folder / "model.bias.npy"))


def test_its_writer_is_found_by_name_and_writes_what_numpy_reads(registered, npy_folder, tmp_path):
    opened = registry.open_checkpoint(str(npy_folder))
    fmt = registry.format_of(opened.index)
    with open_output(str(tmp_path / "out")) as out:
        files = fmt.write(NpyTarget(opened.index, Fetcher(opened.source)), out, RunContext())
    assert sorted(files) == ["model.bias.npy", "model.weight.npy"]
    for name in files:
        assert np.array_equal(np.load(tmp_path / "out" / name), np.load(npy_folder / name))
