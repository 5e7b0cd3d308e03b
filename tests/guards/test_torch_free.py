"""Reading and copying checkpoints without importing torch, and writing what torch writes.

inspect, verify, reshard and consolidate (no cast) never import torch (1-2 s of every command);
the stand-ins they use instead (ckptkit.torch_types) must pickle exactly as torch's own objects
and become torch's objects where values leave ckptkit.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict

import pytest
import torch

from conftest import DATA as FIXTURES
from ckptkit.formats.dcp.writer import _Written, build_metadata
from ckptkit.runner.torch_archive import load_bytes_archive
from ckptkit.formats.torch_save.archive_writer import write_archive_to
from ckptkit.index.serialize import safe_value
from ckptkit.index.types import Box, CheckpointIndex, ObjectEntry, TensorEntry
from ckptkit.runner.fetch import Fetcher
from ckptkit.safeload import restricted_loads
from ckptkit.safeload import realize
from ckptkit.torch_types import DType, Size, SmallTensor
from helpers.torch_import_probe import torch_imported

DS = FIXTURES / "deepspeed"


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "{ds}/z3_bf16_w2"],
        ["inspect", "{fx}/fsdp2_w2", "--json"],
        ["inspect", "{fx}/plain_state_dict.pt"],
        ["verify", "{ds}/z2_fp16_w2"],
        ["reshard", "{ds}/z3_bf16_w2", "{out}", "--to", "3"],
        ["reshard", "{ds}/z1_fp16_w3", "{out}", "--to", "2"],
        ["reshard", "{fx}/fsdp2_w2", "{out}", "--to", "3"],
        ["consolidate", "{fx}/fsdp2_w2", "{out}", "--include-optimizer"],
        ["consolidate", "{ds}/z3_fp32_w2", "{out}"],
        ["convert", "{ds}/z3_fp32_w2", "{out}", "--to", "dcp"],
        ["convert", "{ds}/z2_fp32_w2", "{out}", "--to", "torch"],
    ],
    ids=lambda a: " ".join(a[:2]).replace("{ds}/", "").replace("{fx}/", ""),
)
def test_light_commands_do_not_import_torch(args, tmp_path):
    args = [a.format(ds=DS, fx=FIXTURES, out=tmp_path / "out") for a in args]
    assert not torch_imported(args)


def test_a_cast_imports_torch(tmp_path):
    """The probe can fail: consolidating bf16 to fp16 needs torch to convert the values."""
    assert torch_imported(["consolidate", str(FIXTURES / "fsdp2_w2"), str(tmp_path / "out"), "--dtype", "fp16"])


def _metadata_inputs():
    index = CheckpointIndex(format="dcp", root="x")
    index.add_tensor(TensorEntry("model.w", "bfloat16", (4, 3), [], path=("model", "w")))
    index.add_tensor(TensorEntry("optim.state.w.step", "float32", (), [], path=("optim", "state", "w", "step")))
    index.add_object(ObjectEntry("optim.param_groups.0.lr", 0.1, path=("optim", "param_groups", 0, "lr")))
    written = [
        _Written("model.w", Box((0, 0), (2, 3)), "__0_0.distcp", 0, 100),
        _Written("model.w", Box((2, 0), (2, 3)), "__1_0.distcp", 0, 100),
        _Written("optim.state.w.step", Box((), ()), "__0_0.distcp", 100, 50),
        _Written("optim.param_groups.0.lr", None, "__0_0.distcp", 150, 30, ("zstd",)),
    ]
    return index, written


def test_dcp_metadata_is_what_torch_pickles():
    """The stand-ins pickle byte for byte as torch's own Metadata classes built from the same data."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    index, written = _metadata_inputs()
    ours = build_metadata(index, written)
    loaded = pickle.loads(ours)  # torch's own classes
    w = TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16),
        torch.Size([4, 3]),
        [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
        ],
    )
    step = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([]), [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
    )
    storage = {
        MetadataIndex("model.w", [0, 0], 0): _StorageInfo("__0_0.distcp", 0, 100),
        MetadataIndex("model.w", [2, 0], 1): _StorageInfo("__1_0.distcp", 0, 100),
        MetadataIndex("optim.state.w.step", [], 0): _StorageInfo("__0_0.distcp", 100, 50),
        MetadataIndex("optim.param_groups.0.lr"): _StorageInfo("__0_0.distcp", 150, 30, ["zstd"]),
    }
    expected = Metadata(
        state_dict_metadata={
            "model.w": w,
            "optim.state.w.step": step,
            "optim.param_groups.0.lr": BytesStorageMetadata(),
        },
        planner_data={
            "model.w": ("model", "w"),
            "optim.state.w.step": ("optim", "state", "w", "step"),
            "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr"),
        },
        storage_data=storage,
        storage_meta=StorageMeta(save_id=loaded.storage_meta.save_id),
        version="1.0.0",
    )
    assert loaded == expected
    assert ours == pickle.dumps(expected, protocol=2)


def _archive_bytes(structure, fetcher=None) -> bytes:
    buf = io.BytesIO()
    write_archive_to(buf, structure, fetcher or Fetcher(None), slab_bytes=1 << 20)
    return buf.getvalue()


def test_stand_ins_pickle_as_torch_objects():
    """A structure of stand-ins written by ckptkit equals torch.save of the torch objects: same
    data.pkl bytes, and torch.load(weights_only=True) returns them."""
    stand_ins = {
        "shape": Size([2, 3]),
        "dtype": DType("bfloat16"),
        "half": DType("float16"),
        "step": SmallTensor("float32", (), struct.pack("<f", 7.0)),
        "ids": SmallTensor("int64", (3,), (1).to_bytes(8, "little") * 3),
        "nested": OrderedDict(a=[Size([1]), (DType("int8"), 2)]),
    }
    real = realize(stand_ins)
    assert real["shape"] == torch.Size([2, 3]) and type(real["shape"]) is torch.Size
    assert real["dtype"] is torch.bfloat16 and realize(DType("float")) is torch.float32
    assert torch.equal(real["step"], torch.tensor(7.0)) and torch.equal(real["ids"], torch.ones(3, dtype=torch.int64))
    ours = _archive_bytes(stand_ins)
    theirs = io.BytesIO()
    torch.save(real, theirs)
    pkl = [n for n in zipfile.ZipFile(io.BytesIO(ours)).namelist() if n.endswith("data.pkl")][0]
    assert zipfile.ZipFile(io.BytesIO(ours)).read(pkl) == zipfile.ZipFile(io.BytesIO(theirs.getvalue())).read(
        [n for n in zipfile.ZipFile(io.BytesIO(theirs.getvalue())).namelist() if n.endswith("data.pkl")][0]
    )
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert back["shape"] == real["shape"] and back["dtype"] is torch.bfloat16 and back["half"] is torch.float16
    assert torch.equal(back["step"], real["step"]) and torch.equal(back["ids"], real["ids"])
    assert back["nested"]["a"][1][0] is torch.int8


def test_reading_builds_stand_ins_and_value_realizes():
    buf = io.BytesIO()
    value = {
        "size": torch.Size([4]),
        "dtype": torch.float16,
        "dev": torch.device("cpu"),
        "t": torch.arange(6, dtype=torch.int32).view(2, 3).t(),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    }
    torch.save(value, buf)
    data = load_bytes_archive(buf.getvalue(), "mem")
    assert type(data["size"]) is Size and data["dtype"] is DType("float16")
    assert isinstance(data["t"], SmallTensor) and data["t"].shape == (3, 2)  # a transposed view, made contiguous
    assert safe_value(data["b"]) == {"__tensor__": {"dtype": "bfloat16", "shape": [2], "values": [1.5, -2.0]}}
    assert safe_value(data["t"])["__tensor__"]["values"] == [0, 3, 1, 4, 2, 5]
    entry = ObjectEntry("x", data)
    real = entry.value
    assert type(real["size"]) is torch.Size and real["dtype"] is torch.float16 and real["dev"] == torch.device("cpu")
    assert torch.equal(real["t"], value["t"]) and torch.equal(real["b"], value["b"])
    assert entry.value is real  # realized once


def test_small_tensor_needs_its_bytes():
    """A pickle whose tensor view runs past its storage is refused, not read out of bounds."""
    buf = io.BytesIO()
    torch.save(torch.zeros(4), buf)
    raw = bytearray(buf.getvalue())
    zf = zipfile.ZipFile(io.BytesIO(bytes(raw)))
    pkl = zf.read([n for n in zf.namelist() if n.endswith("data.pkl")][0])
    # the same pickle over a storage of 2 elements instead of 4
    from ckptkit.errors import FormatError
    from ckptkit.safeload import RawStorage, typed_storage

    with pytest.raises(FormatError, match="needs 16 bytes"):
        restricted_loads(pkl, "mem", lambda pid: typed_storage(RawStorage(bytes(8)), DType("float32")))


@pytest.mark.parametrize("view", ["transposed", "permuted", "expanded", "stepped"])
def test_strided_values_load_as_torch_saved_them(view):
    base = torch.arange(24, dtype=torch.float32)
    value = {
        "transposed": base.view(4, 6).t(),
        "permuted": base.view(2, 3, 4).permute(2, 0, 1),
        "expanded": torch.tensor([1.5]).expand(5, 3),
        "stepped": base[1::5],
    }[view]
    buf = io.BytesIO()
    torch.save({"v": value}, buf)
    loaded = load_bytes_archive(buf.getvalue(), "mem")["v"]
    assert isinstance(loaded, SmallTensor) and loaded.shape == tuple(value.shape)
    assert torch.equal(realize(loaded), value)


def test_a_small_storage_viewed_as_a_huge_tensor_is_refused():
    """A stride-0 view costs torch nothing but would cost a copy of its full size: refused."""
    from ckptkit.errors import FormatError

    buf = io.BytesIO()
    torch.save({"v": torch.zeros(1).expand(100_000_000)}, buf)
    with pytest.raises(FormatError, match="strided view of 400000000 bytes"):
        load_bytes_archive(buf.getvalue(), "mem")


def test_a_value_nested_too_deeply_is_a_format_error():
    from ckptkit.errors import FormatError

    deep: list = []
    for _ in range(20000):
        deep = [deep]
    with pytest.raises(FormatError, match="nested too deeply"):
        ObjectEntry("k", deep).value
