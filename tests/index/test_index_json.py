"""The index's JSON form: schema-versioned, and JSON -> index -> JSON is stable."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ckptkit.formats.registry import open_checkpoint
from ckptkit.index.serialize import SCHEMA, from_json, to_json
from ckptkit_cli.main import cli
from conftest import DATA


@pytest.mark.parametrize("name", ["fsdp2_w2", "fsdp1_sharded_w2", "plain_state_dict.pt"])
def test_json_round_trip(name):
    index = open_checkpoint(str(DATA / name)).index
    doc = json.loads(json.dumps(to_json(index)))
    assert doc["schema"] == SCHEMA
    again = from_json(doc)
    assert set(again.tensors) == set(index.tensors)
    for key, t in index.tensors.items():
        assert again.tensors[key].pieces == t.pieces
        assert again.tensors[key].shape == t.shape and again.tensors[key].dtype == t.dtype
        assert again.tensors[key].path == t.path
    assert json.loads(json.dumps(to_json(again))) == doc


def test_inspect_json_prints_the_index():
    result = CliRunner().invoke(cli, ["inspect", "--json", str(DATA / "fsdp2_w2")])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["schema"] == SCHEMA
    assert doc["summary"]["world_size"] == 2
    assert doc["summary"]["tensors"] == 40
    assert {o["key"]: o["value"] for o in doc["objects"]}["extra.note"] == "hello"


def test_inspect_table():
    result = CliRunner().invoke(cli, ["inspect", str(DATA / "fsdp2_w3")])
    assert result.exit_code == 0, result.output
    assert "format      dcp" in result.output and "world size  3" in result.output
    assert "model.embed.weight" in result.output and "extra.note = hello" in result.output
