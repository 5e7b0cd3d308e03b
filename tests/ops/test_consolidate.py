"""consolidate: safetensors that the safetensors library loads and that equal the truth."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckptkit.ops.consolidate import consolidate
from conftest import DATA, assert_tensor_equal, dcp_params, load_truth


def _load_dir(path, prefix="model"):
    out = {}
    for f in sorted(path.glob(f"{prefix}*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", dcp_params())
def test_consolidate_dcp_equals_truth(tmp_path, name):
    truth = load_truth(name)
    res = consolidate(str(DATA / name), str(tmp_path / "out"))
    loaded = _load_dir(tmp_path / "out")
    model_truth = {k[len("model.") :]: v for k, v in truth.items() if k.startswith("model.")}
    assert set(loaded) == set(model_truth)
    for key, expected in model_truth.items():
        assert_tensor_equal(loaded[key], expected, key)
    assert res.files == ["model.safetensors"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"


def test_consolidate_torch_save_writes_tied_weights_once(tmp_path):
    truth = torch.load(DATA / "plain_state_dict.pt", weights_only=True)
    res = consolidate(str(DATA / "plain_state_dict.pt"), str(tmp_path / "out"))
    assert res.aliases == {"lm_head.weight": "embed.weight"}
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "lm_head.weight" not in loaded
    for key, expected in truth.items():
        if key != "lm_head.weight":
            assert_tensor_equal(loaded[key], expected.contiguous(), key)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["ckptkit.aliases"]) == {"lm_head.weight": "embed.weight"}
    # reading our own output restores the alias
    from conftest import read_all

    _, tensors, _ = read_all(tmp_path / "out")
    assert_tensor_equal(tensors["lm_head.weight"], truth["lm_head.weight"], "lm_head.weight")


def test_consolidate_dtype_casts_only_floating_tensors(tmp_path):
    truth = load_truth("fsdp2_w2")
    consolidate(str(DATA / "fsdp2_w2"), str(tmp_path / "out"), dtype="bfloat16")
    loaded = _load_dir(tmp_path / "out")
    assert loaded["pos"].dtype == torch.bfloat16
    assert torch.equal(loaded["pos"], truth["model.pos"].to(torch.bfloat16))
    assert loaded["positions"].dtype == torch.int64 and loaded["keep"].dtype == torch.bool
    assert loaded["temperature"].shape == () and loaded["temperature"].dtype == torch.bfloat16


def test_consolidate_shards_and_index(tmp_path):
    truth = load_truth("fsdp2_w3")
    res = consolidate(str(DATA / "fsdp2_w3"), str(tmp_path / "out"), max_shard_size="1KB")
    assert len(res.files) > 2 and res.files[0] == f"model-00001-of-{len(res.files):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {k[len("model.") :] for k in truth if k.startswith("model.")}
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for k, v in truth.items() if k.startswith("model.")
    )
    loaded = _load_dir(tmp_path / "out")
    for name, file in index["weight_map"].items():
        assert name in load_file(str(tmp_path / "out" / file))
        assert_tensor_equal(loaded[name], truth["model." + name], name)


def test_consolidate_include_optimizer(tmp_path):
    truth = load_truth("fsdp2_w2")
    res = consolidate(str(DATA / "fsdp2_w2"), str(tmp_path / "out"), include_optimizer=True)
    assert "optimizer.safetensors" in res.files
    opt = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    optim_truth = {
        k[len("optim.") :]: v for k, v in truth.items() if k.startswith("optim.") and isinstance(v, torch.Tensor)
    }
    assert set(opt) == set(optim_truth)
    for key, expected in optim_truth.items():
        assert_tensor_equal(opt[key], expected, key)
    with safe_open(str(tmp_path / "out" / "optimizer.safetensors"), framework="pt") as f:
        objects = json.loads(f.metadata()["ckptkit.objects"])
    assert objects["param_groups.1.weight_decay"] == 0.0
    assert objects["param_groups.0.params"] == truth["optim.param_groups.0.params"]


def test_consolidate_resharded_output_still_equals_truth(tmp_path):
    from ckptkit.ops.reshard import reshard

    truth = load_truth("fsdp2_w2")
    reshard(str(DATA / "fsdp2_w2"), str(tmp_path / "r3"), 3)
    consolidate(str(tmp_path / "r3"), str(tmp_path / "out"))
    loaded = _load_dir(tmp_path / "out")
    for key, value in truth.items():
        if key.startswith("model."):
            assert_tensor_equal(loaded[key[len("model.") :]], value, key)


def test_consolidated_folder_with_optimizer_keeps_roles(tmp_path):
    """Reading consolidate's own output back: optimizer*.safetensors stay optimizer state."""
    consolidate(str(DATA / "fsdp2_w2"), str(tmp_path / "once"), include_optimizer=True)
    res = consolidate(str(tmp_path / "once"), str(tmp_path / "twice"))
    assert res.model_tensors == 13 and res.optimizer_tensors == 0
    assert set(_load_dir(tmp_path / "twice")) == set(_load_dir(tmp_path / "once"))
    res = consolidate(str(tmp_path / "once"), str(tmp_path / "thrice"), include_optimizer=True)
    assert res.optimizer_tensors == 27


def test_consolidate_from_fsspec_url(tmp_path):
    """SRC may be an fsspec URL: bytes come through range reads of the remote files."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for f in (DATA / "fsdp2_w3").iterdir():
        fs.pipe(f"/ckpt/{f.name}", f.read_bytes())
    truth = load_truth("fsdp2_w3")
    consolidate("memory://ckpt", str(tmp_path / "out"))
    loaded = _load_dir(tmp_path / "out")
    for key, value in truth.items():
        if key.startswith("model."):
            assert_tensor_equal(loaded[key[len("model.") :]], value, key)
