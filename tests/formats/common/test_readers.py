"""Each reader equals the ground truth bit for bit on checkpoints the frameworks wrote."""

from __future__ import annotations

import pytest
import torch

from conftest import DATA, assert_tensor_equal, dcp_params, load_truth, read_all


@pytest.mark.parametrize("name", dcp_params())
def test_dcp_reader_equals_truth(name):
    truth = load_truth(name)
    opened, tensors, objects = read_all(DATA / name)
    assert opened.index.format == "dcp"
    assert opened.index.world_size == (2 if name.endswith("w2") else 3)
    truth_tensors = {k: v for k, v in truth.items() if isinstance(v, torch.Tensor)}
    truth_objects = {k: v for k, v in truth.items() if not isinstance(v, torch.Tensor)}
    assert set(tensors) == set(truth_tensors)
    for key, expected in truth_tensors.items():
        assert_tensor_equal(tensors[key], expected, key)
    assert set(objects) == set(truth_objects)
    for key, expected in truth_objects.items():
        assert objects[key] == expected, key


def test_dcp_reader_keeps_zero_size_chunks_and_nesting():
    opened, _, _ = read_all(DATA / "fsdp2_w2")
    gate = opened.index.tensors["model.gate"]
    sizes = sorted(p.region.sizes for p in gate.pieces)
    assert sizes == [(0, 6), (1, 6)]  # FSDP2 on a dim smaller than the world size
    assert opened.index.tensors["optim.state.embed.weight.exp_avg"].path == (
        "optim",
        "state",
        "embed.weight",
        "exp_avg",
    )
    assert opened.index.objects["optim.param_groups.1.lr"].path == ("optim", "param_groups", 1, "lr")


def test_rank_local_metadata_is_merged():
    opened, _, _ = read_all(DATA / "dcp_rank_local_w2")
    assert opened.index.metadata["metadata_files"] == ["__0.metadata", "__1.metadata"]


def test_compressed_items_are_located_lazily():
    pytest.importorskip("zstandard", reason="reading zstd-compressed DCP items needs the zstandard package")
    opened, _, _ = read_all(DATA / "dcp_zstd_w2")
    piece = opened.index.tensors["model.pos"].pieces[0]
    assert piece.location.encoding == "torch_save"
    assert piece.location.transforms == ("stream.zstd/1",)


@pytest.mark.parametrize("name", ["plain_state_dict.pt", "fsdp1_full_state_dict.pt"])
def test_torch_save_reader_equals_torch_load(name):
    truth = torch.load(DATA / name, weights_only=True)
    opened, tensors, objects = read_all(DATA / name)
    assert opened.index.format == "torch_save"
    assert set(tensors) == set(truth)
    for key, expected in truth.items():
        assert_tensor_equal(tensors[key], expected, key)


def test_torch_save_reader_honours_strides_and_shared_storage():
    opened, tensors, _ = read_all(DATA / "plain_state_dict.pt")
    t = opened.index.tensors["extra_transposed"]
    assert t.pieces[0].location.stride == (1, 6)
    emb, head = opened.index.tensors["embed.weight"], opened.index.tensors["lm_head.weight"]
    assert emb.pieces[0].location == head.pieces[0].location  # tied: the very same bytes


def test_safetensors_reader_equals_library(tmp_path):
    from safetensors.torch import save_file

    values = {
        "a": torch.randn(3, 4),
        "b": torch.arange(7, dtype=torch.int32),
        "c": torch.tensor(True),
        "d": torch.randn(2, 2).to(torch.bfloat16),
        "e": torch.zeros(0, 3),
    }
    save_file(values, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    opened, tensors, _ = read_all(tmp_path / "model.safetensors")
    assert opened.index.format == "safetensors"
    for key, expected in values.items():
        assert_tensor_equal(tensors[key], expected, key)
    opened_dir, tensors_dir, _ = read_all(tmp_path)
    assert set(tensors_dir) == set(values)


def test_dcp_torch23_flattening_convention(tmp_path):
    """torch <= 2.3 kept tensor-free containers as one value (`optim.param_groups`); torch 2.13
    still writes that convention when told to, so the file comes from torch's own writer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _version
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckptkit.ops.reshard import reshard

    state = {
        "model": {"w": torch.randn(5, 3)},
        "optim": {
            "state": {"w": {"exp_avg": torch.randn(5, 3), "step": torch.tensor(2.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}],
        },
    }
    _version._derived_version = "2_3"
    try:
        dcp.save(state, checkpoint_id=str(tmp_path / "old"), no_dist=True)
    finally:
        _version._derived_version = None
    opened, tensors, objects = read_all(tmp_path / "old")
    assert objects["optim.param_groups"] == state["optim"]["param_groups"]
    assert opened.index.objects["optim.param_groups"].path == ("optim", "param_groups")
    assert_tensor_equal(tensors["optim.state.w.exp_avg"], state["optim"]["state"]["w"]["exp_avg"], "exp_avg")
    reshard(str(tmp_path / "old"), str(tmp_path / "new"), 2)
    dcp_to_torch_save(str(tmp_path / "new"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert full["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert_tensor_equal(full["model"]["w"], state["model"]["w"], "w")


def test_compressed_items_without_codec_give_a_clear_error(monkeypatch):
    """Without a zstd codec, opening names the file, the value and the package to install."""
    import sys

    from ckptkit.errors import MissingDependencyError
    from ckptkit.formats.registry import open_checkpoint

    monkeypatch.setitem(sys.modules, "zstandard", None)
    monkeypatch.setitem(sys.modules, "compression", None)
    with pytest.raises(
        MissingDependencyError,
        match=r"__\d_0\.distcp \(value .*\) is zstd-compressed; "
        r"install the 'zstandard' package",
    ):
        open_checkpoint(str(DATA / "dcp_zstd_w2"))


def test_a_bare_optimizer_state_dict_is_counted_as_optimizer(tmp_path):
    """torch.save(optimizer.state_dict(), "optimizer.pt") holds only optimizer state: inspect must
    not call its moments model tensors (it did: "6 model, 0 optimizer")."""
    import subprocess
    import sys

    from conftest import subprocess_env

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    res = subprocess.run(
        [sys.executable, "-m", "ckptkit", "inspect", str(tmp_path / "optimizer.pt")],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "0 model, 6 optimizer" in res.stdout, res.stdout
