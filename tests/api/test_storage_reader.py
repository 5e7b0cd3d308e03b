"""ckptkit.StorageReader in one process: torch's own dcp.load reading DCP, DeepSpeed ZeRO,
torch.save and safetensors checkpoints through it, equal to what torch's FileSystemReader and the
frameworks' own loaders give; convert's key options; validate_checkpoint_id; the refusals (ckptkit's
sentence at construction, torch's wrapped errors unwrapped), and no checkpoint byte unpickled by
torch's planner."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptkit
from ckptkit.errors import CkptkitError, FormatError, NotACheckpointError, UnsafePickleError
from ckptkit.index.dtypes import torch_dtype
from conftest import DATA, ROOT, assert_tensor_equal
from helpers.ds_fixtures import DS_DATA

sys.path.insert(0, str(ROOT / "fixtures"))
import models  # noqa: E402


def _load(state: dict, reader) -> None:
    """dcp.load in one process (torch warns that it assumes so: expected here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader)


def _fresh_state(seed: int = models.MODEL_SEED + 7) -> tuple:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = models.make_model(seed)
    optim = models.make_optimizer(model)
    msd, osd = get_state_dict(model, optim)  # creates AdamW's state to load into
    return model, optim, {"model": msd, "optim": osd}


def _flat(state: dict) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return dict(flatten_state_dict(state)[0])


def test_a_dcp_checkpoint_loads_as_torchs_own_reader_loads_it():
    """Every tensor and value equal (bit for bit, same types) to dcp.load through FileSystemReader."""
    from torch.distributed.checkpoint import FileSystemReader

    *_, want = _fresh_state()
    _load(want, FileSystemReader(str(DATA / "fsdp2_w2")))
    *_, got = _fresh_state(seed=models.MODEL_SEED + 8)
    _load(got, ckptkit.StorageReader(DATA / "fsdp2_w2"))
    flat_got, flat_want = _flat(got), _flat(want)
    assert set(flat_got) == set(flat_want) and len(flat_want) > 20
    for key, value in flat_want.items():
        if isinstance(value, torch.Tensor):
            assert_tensor_equal(flat_got[key], value, key)
        else:
            assert type(flat_got[key]) is type(value) and flat_got[key] == value, key


def test_a_zero3_checkpoint_fills_a_torch_model_and_its_optimizer():
    """DeepSpeed's own truth (fp32 masters, moments, frozen weights, group lr) through plain
    dcp.load + set_state_dict."""
    import deepspeed_models as dm
    import generate_convert as gc
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = dm.make_model(dm.MODEL_SEED + 5)
    optim = gc.make_optimizer(model)
    msd, osd = get_state_dict(model, optim)
    _load({"model": msd, "optim": osd}, ckptkit.StorageReader(str(DS_DATA / "z3_fp32_w2")))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    truth = torch.load(DS_DATA / "z3_fp32_w2.truth.pt", weights_only=True)
    params = dict(model.named_parameters())
    compared = 0
    for key, value in truth.items():
        kind, _, name = key.partition(".")
        if kind == "fp32":
            assert_tensor_equal(params[name].detach(), value, key)
            state = optim.state[params[name]]
            assert_tensor_equal(state["exp_avg"], truth[f"exp_avg.{name}"], name)
            assert_tensor_equal(state["exp_avg_sq"], truth[f"exp_avg_sq.{name}"], name)
            assert_tensor_equal(state["step"], torch.tensor(float(truth["global_steps"])), name)
            compared += 1
        elif kind == "frozen":
            assert_tensor_equal(model.get_parameter(name).detach(), value, key)
        elif kind == "buffer":
            assert_tensor_equal(model.get_buffer(name), value, key)
    assert compared == 9
    assert [g["lr"] for g in optim.param_groups] == [truth["lr.0"], truth["lr.1"]]


def test_a_torch_save_file_and_a_safetensors_file_load_as_their_own_loaders_read_them(tmp_path):
    from safetensors.torch import load_file, save_file

    weights = {"layer.weight": torch.randn(6, 4), "layer.bias": torch.randn(6).to(torch.bfloat16)}
    torch.save(weights, tmp_path / "w.pt")
    save_file(weights, str(tmp_path / "w.safetensors"))
    for path, truth in (
        (tmp_path / "w.pt", torch.load(tmp_path / "w.pt", weights_only=True)),
        (tmp_path / "w.safetensors", load_file(str(tmp_path / "w.safetensors"))),
    ):
        state = {"model": {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in weights.items()}}
        _load(state, ckptkit.StorageReader(str(path)))
        for k, v in truth.items():
            assert_tensor_equal(state["model"][k], v, f"{path.name}:{k}")


def test_read_data_serves_exactly_the_box_a_read_item_asks_for():
    """A state dict asking for a slice (as a DTensor's local shard does) gets exactly that slice,
    read from the checkpoint's pieces: read_data serves the ReadItem's storage offsets/lengths."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = ckptkit.StorageReader(str(DS_DATA / "z3_fp32_w2"))
    truth = torch.load(DS_DATA / "z3_fp32_w2.truth.pt", weights_only=True)["fp32.embed.weight"]
    target = torch.zeros(5, 3)

    class Planner:
        def resolve_tensor(self, item):
            return target

        def commit_tensor(self, item, tensor):
            assert tensor.data_ptr() == target.data_ptr()  # filled in place

    item = ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex("model.embed.weight"),
        torch.Size([0, 0]),
        MetadataIndex("model.embed.weight", torch.Size([0, 0])),
        torch.Size([30, 4]),
        torch.Size([5, 3]),
    )
    reader.read_data(LoadPlan([item]), Planner()).wait()
    assert_tensor_equal(target, truth[30:35, 4:7], "box")


def test_strip_prefix_and_rename_follow_converts_rules(tmp_path):
    weights = {"backbone.layer.weight": torch.randn(3, 2), "backbone.head.bias": torch.randn(3)}
    torch.save(weights, tmp_path / "w.pt")
    stripped = {"model": {"layer.weight": torch.zeros(3, 2), "head.bias": torch.zeros(3)}}
    _load(stripped, ckptkit.StorageReader(str(tmp_path / "w.pt"), strip_prefix="backbone."))
    assert_tensor_equal(stripped["model"]["layer.weight"], weights["backbone.layer.weight"], "strip")
    renamed = {"model": {"net.layer.weight": torch.zeros(3, 2), "net.head.bias": torch.zeros(3)}}
    _load(renamed, ckptkit.StorageReader(str(tmp_path / "w.pt"), rename=["backbone.=net."]))
    assert_tensor_equal(renamed["model"]["net.head.bias"], weights["backbone.head.bias"], "rename")
    with pytest.raises(CkptkitError, match="expected OLD=NEW"):
        ckptkit.StorageReader(str(tmp_path / "w.pt"), rename="backbone.")


def test_validate_checkpoint_id_answers_for_what_ckptkit_reads(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "w.pt")
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    (tmp_path / "empty").mkdir()
    valid = ckptkit.StorageReader.validate_checkpoint_id
    for path in (
        DATA / "fsdp2_w2",
        DS_DATA / "z3_fp32_w2",
        DATA / "ds_tp" / "autotp_z2_fp32",
        DATA / "trainer" / "ddp",
        DATA / "trainer" / "ddp" / "checkpoint-2" / "model.safetensors",
        tmp_path / "w.pt",
        str(tmp_path / "w.pt"),
    ):
        assert valid(path), path
    for path in (tmp_path / "notes.txt", tmp_path / "empty", tmp_path / "missing", 42, None, ""):
        assert not valid(path), path


def test_a_path_that_is_no_checkpoint_is_ckptkits_sentence_when_the_reader_is_made(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(NotACheckpointError) as info:
        ckptkit.StorageReader(str(tmp_path))
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran_code_marker",))


def test_a_value_that_would_run_code_is_refused_and_never_unpickled(tmp_path, monkeypatch):
    """torch's planner unpickles bytes items with weights_only=False: the checkpoint's own bytes
    must never reach it. Here the restricted loader refuses the value before dcp.load starts."""
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.zeros(2), "evil": _RunsCode()}, checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(UnsafePickleError, match="evil|os|system"):
        reader = ckptkit.StorageReader(str(tmp_path / "c"))
        _load({"w": torch.zeros(2), "evil": None}, reader)
    assert not (tmp_path / "ran_code_marker").exists()


def test_values_reach_the_state_dict_through_a_fresh_pickle(tmp_path):
    """A plain value comes back equal (torch's planner reads it from the bytes read_data hands it)."""
    ckptkit.save({"w": torch.ones(2), "meta": {"epoch": 3, "names": ["a", "b"], "lr": 0.5}}, str(tmp_path / "c"))
    state = {"w": torch.zeros(2), "meta": {"epoch": 0, "names": [], "lr": 0.0}}
    _load(state, ckptkit.StorageReader(str(tmp_path / "c")))
    assert state["meta"] == {"epoch": 3, "names": ["a", "b"], "lr": 0.5}
    assert_tensor_equal(state["w"], torch.ones(2), "w")


def test_a_key_the_checkpoint_lacks_is_named_by_torch_and_in_ckptkits_sentence():
    *_, state = _fresh_state()
    state["model"]["not_there"] = torch.zeros(2)
    reader = ckptkit.StorageReader(str(DATA / "fsdp2_w2"))
    with pytest.raises(CheckpointException) as raw:
        _load(state, reader)
    assert "model.not_there" in str(raw.value)
    with pytest.raises(FormatError) as worded:
        reader.load(state)
    text = str(worded.value)
    assert text.startswith(f"{DATA / 'fsdp2_w2'}: has no model.not_there (the checkpoint holds") and "\n" not in text


def test_a_shape_that_differs_is_worded_as_ckptkit_load_words_it():
    reader = ckptkit.StorageReader(str(DATA / "fsdp2_w2"))
    with pytest.raises(
        FormatError,
        match=r"model\.pos has shape \[5, 10\] in the checkpoint, the state dict "
        r"expects \[3, 3\]$",
    ):
        reader.load({"model": {"pos": torch.zeros(3, 3)}})


def test_a_file_damaged_after_the_reader_was_made_is_ckptkits_sentence(tmp_path):
    """An error inside read_data reaches the caller of dcp.load wrapped by torch; unwrap (and
    StorageReader.load) give ckptkit's error back."""
    from safetensors.torch import save_file

    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "w.safetensors"))
    reader = ckptkit.StorageReader(str(tmp_path / "w.safetensors"))
    size = (tmp_path / "w.safetensors").stat().st_size
    with open(tmp_path / "w.safetensors", "r+b") as f:
        f.truncate(size - 1000)
    state = {"model": {"w": torch.zeros(64, 64)}}
    with pytest.raises(CheckpointException) as raw:
        _load(state, reader)
    unwrapped = reader.unwrap(raw.value)
    assert isinstance(unwrapped, CkptkitError) and "w.safetensors" in str(unwrapped)
    with pytest.raises(CkptkitError) as direct:
        reader.load(state)
    assert str(direct.value) == str(unwrapped) and "\n" not in str(unwrapped)


def test_unwrap_leaves_other_exceptions_alone():
    reader = ckptkit.StorageReader(str(DATA / "fsdp2_w2"))
    exc = ValueError("something else")
    assert reader.unwrap(exc) is exc


def _titan_state(model, optim) -> dict:
    """torchtitan's layout: the model's names at the top level, the optimizer flattened by torch
    under "optimizer" (state.<fqn>.<what>, param_groups.<fqn>.<hyper>)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    return {**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim, options=opts)}


def _set_titan(model, optim, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    msd = {k: v for k, v in state.items() if k != "optimizer"}
    set_state_dict(
        model,
        optim,
        model_state_dict=msd,
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(flatten_optimizer_state_dict=True),
    )


@pytest.mark.parametrize("source", ["zero3", "dcp"])
def test_torchtitans_layout_loads_with_its_container_prefixes(source):
    """model_prefix="" and optim_prefix="optimizer." fill torchtitan's state dict, per-parameter
    group values included, equal to the default layout's load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if source == "zero3":
        import deepspeed_models as dm
        import generate_convert as gc

        path, make = (
            str(DS_DATA / "z3_fp32_w2"),
            lambda seed: (lambda m: (m, gc.make_optimizer(m)))(dm.make_model(seed)),
        )
    else:
        path, make = (
            str(DATA / "fsdp2_w2"),
            lambda seed: (lambda m: (m, models.make_optimizer(m)))(models.make_model(seed)),
        )
    model, optim = make(101)
    msd, osd = get_state_dict(model, optim)
    _load({"model": msd, "optim": osd}, ckptkit.StorageReader(path))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    titan_model, titan_optim = make(102)
    state = _titan_state(titan_model, titan_optim)
    assert "optimizer" in state and not any(k.startswith("model.") for k in state if k != "optimizer")
    _load(state, ckptkit.StorageReader(path, model_prefix="", optim_prefix="optimizer."))
    _set_titan(titan_model, titan_optim, state)
    want, got = (
        _flat(dict(zip(("model", "optim"), get_state_dict(model, optim)))),
        _flat(dict(zip(("model", "optim"), get_state_dict(titan_model, titan_optim)))),
    )
    assert set(got) == set(want) and len(want) > 20
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert_tensor_equal(got[key], value, key)
        else:
            assert got[key] == value, key
    assert [g["lr"] for g in titan_optim.param_groups] == [g["lr"] for g in optim.param_groups]
    if source == "zero3":  # DeepSpeed's scheduled lr, not the fresh optimizer's
        assert [g["lr"] for g in titan_optim.param_groups] == [0.0036, 0.0036]


def test_container_prefixes_are_checked():
    with pytest.raises(CkptkitError, match="model_prefix='model' must be"):
        ckptkit.StorageReader(str(DATA / "fsdp2_w2"), model_prefix="model")


def test_the_integrations_example_runs(tmp_path, monkeypatch):
    import re

    text = (ROOT / "docs" / "integrations.md").read_text()
    blocks = re.findall(r"<!-- run -->\n```python\n(.*?)```", text, re.S)
    assert blocks, "docs/integrations.md lost its runnable example"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/integrations.md", "exec"), {})


FORMATS = [
    DS_DATA / "z1_bf16_w2",
    DS_DATA / "z2_fp16_w2",
    DATA / "ds_pp" / "pp2_dp2_z1_bf16",
    DATA / "ds_moe" / "moe_z2_bf16_w2_k2",
    DATA / "ds_3d" / "pp2_tp2_dp1_z1_fp32",
    DATA / "ds_moe_tp" / "moetp_z2_fp32_tp2_ep2_w4",
    DATA / "ds_tp" / "mpu_z3_fp32",
    DATA / "fsdp1_sharded_w2",
    DATA / "fsdp1_full_state_dict.pt",
    DATA / "plain_state_dict.pt",
    DATA / "trainer" / "ds_z2",
    DATA / "trainer" / "fsdp2_full",
    DATA / "lightning" / "fsdp_sharded_w2",
    DATA / "lightning" / "single_w1.ckpt",
    DATA / "convert" / "accelerate_fsdp1_w2",
]


@pytest.mark.parametrize("path", FORMATS, ids=lambda p: p.name)
def test_every_format_loads_as_ckptkit_load_fills_it(path):
    """The whole checkpoint, every tensor and value, through dcp.load and the reader, equal to what
    ckptkit.load (proven against each framework's own loader) fills; and where the fixture has a
    truth file (DeepSpeed's fp32 masters and moments, torch's flat state), equal to it."""
    reader = ckptkit.StorageReader(str(path))
    own = {n for n, k in reader.names.items() if n == k}  # the index's names (no per-parameter group aliases)

    def template():
        return {
            n: (torch.zeros(e.shape, dtype=torch_dtype(e.dtype)) if (e := reader.index.tensors.get(n)) else None)
            for n in own
        }

    got, want = template(), template()
    _load(got, reader)
    ckptkit.load(want, str(path))
    assert got.keys() == want.keys() and any(isinstance(v, torch.Tensor) for v in got.values())
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert_tensor_equal(got[key], value, key)
        else:
            assert got[key] == value, key
    truth_file = path.parent / f"{path.name}.truth.pt"
    if truth_file.exists():
        truth = torch.load(truth_file, weights_only=True)
        pairs = [(f"model.{k[5:]}", k) for k in truth if k.startswith("fp32.")]
        pairs += [
            (f"optim.state.{k.split('.', 1)[1]}.{k.split('.', 1)[0]}", k)
            for k in truth
            if k.startswith(("exp_avg.", "exp_avg_sq."))
        ]
        pairs += [(k, k) for k in truth if k.startswith(("model.", "optim.state."))]  # a DCP fixture's flat truth
        compared = [
            (mine, theirs)
            for mine, theirs in pairs
            if mine in got and tuple(got[mine].shape) == tuple(truth[theirs].shape)
        ]
        for mine, theirs in compared:
            assert_tensor_equal(got[mine], truth[theirs], mine)
        assert compared, "no tensor of the truth was compared"


def test_a_hub_snapshot_loads_without_follow_links(tmp_path):
    """huggingface_hub's cache layout (snapshot files linking into blobs/): read as the snapshot's
    safetensors, equal to safetensors' own loader, and validate_checkpoint_id says so."""
    from helpers.hf_hub_cache import hf_cache

    snap, tensors = hf_cache(tmp_path)
    assert ckptkit.StorageReader.validate_checkpoint_id(snap)
    state = {"model": {k: torch.zeros_like(v) for k, v in tensors.items()}}
    _load(state, ckptkit.StorageReader(str(snap)))
    for k, v in tensors.items():
        assert_tensor_equal(state["model"][k], v, k)


def test_a_read_item_reads_only_the_bytes_of_its_box(tmp_path):
    """A rank's share of a 4 MB tensor (16 of its 1024 rows) costs the bytes of those rows, not the
    tensor's: read_data reads through ckptkit's fetcher, box by box."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    full = torch.randn(1024, 1024)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    reader = ckptkit.StorageReader(str(tmp_path / "w.safetensors"))
    source = reader.fetcher.source
    counted = []
    real_read, real_readinto = source.read, source.readinto
    source.read = lambda rel, offset, length: counted.append(length) or real_read(rel, offset, length)
    source.readinto = lambda rel, offset, buf: counted.append(len(buf)) or real_readinto(rel, offset, buf)
    target = torch.zeros(16, 1024)

    class Planner:
        def resolve_tensor(self, item):
            return target

        def commit_tensor(self, item, tensor):
            pass

    name = next(n for n in reader.names if n.endswith("w"))
    item = ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex(name),
        torch.Size([0, 0]),
        MetadataIndex(name, torch.Size([0, 0])),
        torch.Size([512, 0]),
        torch.Size([16, 1024]),
    )
    reader.read_data(LoadPlan([item]), Planner()).wait()
    assert_tensor_equal(target, full[512:528], "rows")
    assert sum(counted) == 16 * 1024 * 4, counted


def test_a_checkpoint_id_given_to_dcp_load_is_the_one_read(tmp_path):
    """dcp.load(checkpoint_id=..., storage_reader=reader) resets the reader to that path: the
    checkpoint read is the one named there."""
    ckptkit.save({"w": torch.full((3,), 1.0)}, str(tmp_path / "a"))
    ckptkit.save({"w": torch.full((3,), 2.0)}, str(tmp_path / "b"))
    reader = ckptkit.StorageReader(str(tmp_path / "a"))
    state = {"w": torch.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(tmp_path / "b"), storage_reader=reader)
    assert_tensor_equal(state["w"], torch.full((3,), 2.0), "w")
    assert reader.checkpoint_id == str(tmp_path / "b")


@pytest.mark.parametrize("bad", [42, None, ""])
def test_a_path_that_is_no_path_is_a_usage_error(bad):
    with pytest.raises(CkptkitError, match="takes a checkpoint path"):
        ckptkit.StorageReader(bad)
