"""The one registry of formats: each checkpoint is recognised by exactly one reader, each format
declares what its writer can produce, and operations ask those capabilities, never a format's name."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptkit.errors import NotACheckpointError, UnsupportedError
from ckptkit.formats import registry
from ckptkit.formats.protocols import ANY_WORLD, FSDP2_SHARDS, ONE_WORLD, WHOLE_TENSORS, ZERO_PARTITIONS, Reader, Writer
from ckptkit.formats.registry import capabilities_of, detect, format_named, open_checkpoint
from ckptkit.storage.source import open_source
from conftest import DATA

ROOT = Path(__file__).resolve().parents[3]

FIXTURES = [  # (path under fixtures/data, the one format that recognises it)
    ("fsdp2_w2", "dcp"),
    ("fsdp2_w3", "dcp"),
    ("dcp_zstd_w2", "dcp"),
    ("fsdp1_sharded_w2", "dcp"),
    ("lightning/fsdp_sharded_w2", "dcp"),
    ("deepspeed/z1_bf16_w2", "deepspeed"),
    ("deepspeed/z3_fp32_w2", "deepspeed"),
    ("lightning/deepspeed_z2_w2", "deepspeed"),
    ("plain_state_dict.pt", "torch_save"),
    ("fsdp1_full_state_dict.pt", "torch_save"),
    ("lightning/single_w1.ckpt", "torch_save"),
]


def _detected(path: Path) -> list[str]:
    if path.is_dir():
        return detect(open_source(str(path)))
    return detect(open_source(str(path.parent), only=path.name), path.name)


@pytest.mark.parametrize("rel,fmt", FIXTURES, ids=[r for r, _ in FIXTURES])
def test_each_fixture_is_detected_by_exactly_one_reader(rel, fmt):
    path = DATA / rel
    assert _detected(path) == [fmt]
    assert open_checkpoint(str(path)).index.format == fmt


def test_safetensors_file_and_folder_are_detected_by_exactly_one_reader(tmp_path):
    save_file({"w": torch.ones(2, 3)}, str(tmp_path / "one.safetensors"))
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(2, 3)}, str(folder / "model.safetensors"))
    assert _detected(tmp_path / "one.safetensors") == ["safetensors"]
    assert _detected(folder) == ["safetensors"]
    assert open_checkpoint(str(folder)).index.format == "safetensors"


def test_every_registered_format_is_a_reader_and_a_writer():
    names = [f.name for f in registry.FORMATS]
    assert sorted(names) == ["dcp", "deepspeed", "ds_universal", "mcore", "safetensors", "torch_save"]
    for fmt in registry.FORMATS:
        assert isinstance(fmt, Reader) and isinstance(fmt, Writer), fmt.name
        assert format_named(fmt.name) is fmt


def test_capabilities_answer_what_each_writer_produces():
    dcp, ds = format_named("dcp").capabilities, format_named("deepspeed").capabilities
    ts, st = format_named("torch_save").capabilities, format_named("safetensors").capabilities
    assert dcp.writes(FSDP2_SHARDS) and not dcp.writes(ZERO_PARTITIONS)
    assert ds.writes(ZERO_PARTITIONS) and not ds.writes(FSDP2_SHARDS)
    assert ts.writes(WHOLE_TENSORS) and st.writes(WHOLE_TENSORS)
    assert dcp.world_sizes == ds.world_sizes == ANY_WORLD and ts.world_sizes == st.world_sizes == ONE_WORLD
    assert dcp.writes_world(5) and ds.writes_world(3) and not ts.writes_world(2) and st.writes_world(1)
    assert not dcp.writes_world(0)
    assert dcp.optimizer_state and ds.optimizer_state and ts.optimizer_state and not st.optimizer_state
    assert dcp.reshards and ds.reshards and not ts.reshards and not st.reshards
    assert ds.flat_partitions and not (dcp.flat_partitions or ts.flat_partitions or st.flat_partitions)
    assert dcp.recipe_keys and not ds.recipe_keys
    assert st.library_check and not (dcp.library_check or ds.library_check or ts.library_check)


def test_capabilities_of_an_index_follow_its_reader():
    assert capabilities_of(open_checkpoint(str(DATA / "fsdp2_w2")).index).reshards
    assert capabilities_of(open_checkpoint(str(DATA / "deepspeed" / "z1_bf16_w2")).index).flat_partitions
    assert not capabilities_of(open_checkpoint(str(DATA / "plain_state_dict.pt")).index).reshards


def test_an_unknown_format_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(UnsupportedError) as exc:
        format_named("orbax")
    assert str(exc.value) == (
        "no reader or writer for the format 'orbax' "
        "(ckptkit has deepspeed, ds_universal, mcore, dcp, safetensors, torch_save)"
    )
    (tmp_path / "notes.txt").write_text("hello")
    assert _detected(tmp_path) == []
    unrecognised = r"not a checkpoint ckptkit recognises; found 1 entries \(notes.txt\)"
    with pytest.raises(NotACheckpointError, match=unrecognised):
        open_checkpoint(str(tmp_path))


def test_reshard_asks_the_capability_not_the_name(tmp_path):
    from ckptkit.ops.reshard import reshard

    with pytest.raises(UnsupportedError, match="a torch_save checkpoint is not sharded by world size"):
        reshard(str(DATA / "plain_state_dict.pt"), str(tmp_path / "out"), 2)
    assert not (tmp_path / "out").exists()


# a comparison of a format's name: `x.format == "dcp"`, `format != ...`, `format in ("dcp", ...)`
NAME_COMPARISON = re.compile(r"\bformat\s*(==|!=|not\s+in\s*[(\[]|in\s*[(\[])")


def test_no_operation_compares_format_names():
    files = sorted((ROOT / "ckptkit" / "ops").glob("*.py")) + [
        ROOT / "ckptkit" / "api.py",
        ROOT / "ckptkit" / "convert" / "state.py",
        ROOT / "ckptkit" / "formats" / "dcp" / "writer.py",
    ]
    found = [
        f"{os.path.relpath(f, ROOT)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if NAME_COMPARISON.search(line)
    ]
    assert not found, "ask formats.registry.capabilities_of(index) instead:\n" + "\n".join(found)


def _imported_modules(path: Path) -> list[str]:
    """Every module `path` imports (relative imports resolved), in functions too."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(x for x in (base, node.module) if x)
            found += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return found


WRITER_MODULE = re.compile(r"^ckptkit\.formats\.\w+\.writer$")


def test_operations_write_through_the_registry_not_writer_modules():
    files = sorted((ROOT / "ckptkit" / "ops").glob("*.py")) + [ROOT / "ckptkit" / "api.py"]
    found = [f"{os.path.relpath(f, ROOT)}: {m}" for f in files for m in _imported_modules(f) if WRITER_MODULE.match(m)]
    assert not found, "write with formats.registry.format_named(...).write(target, out, ctx):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "to,fmt,target",
    [
        ("dcp", "dcp", "DcpTarget"),
        ("zero2", "deepspeed", "ZeroStateTarget"),
        ("torch", "torch_save", "TorchSaveTarget"),
        ("hf", "safetensors", "SafetensorsTarget"),
        ("ds-universal", "ds_universal", "UniversalTarget"),
    ],
)
def test_convert_writes_a_typed_target_through_the_registry_writer(tmp_path, monkeypatch, to, fmt, target):
    from ckptkit.ops.convert import convert

    writer = format_named(fmt)
    seen = []
    real = writer.write
    monkeypatch.setattr(writer, "write", lambda t, out, ctx: seen.append(type(t).__name__) or real(t, out, ctx))
    ds_config = str(DATA / "deepspeed" / "z2_fp32_w2" / "ds_config.json") if to == "zero2" else None
    convert(str(DATA / "fsdp2_w2"), str(tmp_path / "o"), to, ds_config=ds_config)
    assert seen == [target]


def test_consolidate_writes_model_and_optimizer_through_the_safetensors_writer(tmp_path, monkeypatch):
    from ckptkit.ops.consolidate import consolidate

    writer = format_named("safetensors")
    seen = []
    real = writer.write
    monkeypatch.setattr(writer, "write", lambda t, out, ctx: seen.append(t.basename) or real(t, out, ctx))
    consolidate(str(DATA / "fsdp2_w2"), str(tmp_path / "o"), include_optimizer=True)
    assert seen == ["model", "optimizer"]
