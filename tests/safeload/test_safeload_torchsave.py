"""A torch.save data.pkl through Python's C unpickler inside safeload.torchsave's fences.

The fast road (lazy loads) must give exactly what ckptkit's own pickle machine gives, or decline
(None: the machine then reads the pickle and words any refusal). Proven on every torch.save
archive of the fixtures (DeepSpeed model and optimizer states of every stage, FSDP full state
dicts, trainer and Lightning checkpoints), on opcode-level mutations of real pickles
(helpers/pickle_mutations), and on the attacks the C unpickler alone falls for: BUILD on a
TensorRef, on a storage type or on an OrderedDict's own attributes, values that contain
themselves or expand when walked, deep nesting, a memo index that allocates gigabytes, and
globals outside the road.
"""

from __future__ import annotations

import collections
import struct
import zipfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ckptkit.formats.deepspeed.standins  # noqa: F401  (DeepSpeed's classes join the allowlist)
from ckptkit.safeload import torchsave as safeload_torchsave
from ckptkit.errors import CkptkitError
from ckptkit.safeload import StorageRef, restricted_loads, storage_pid, typed_storage
from ckptkit.safeload.refs import TensorRef
from ckptkit.torch_types import DType
from conftest import ROOT
from helpers.fast_road import declined_quickly, same_or_declined
from helpers.pickle_mutations import FUZZ, SEEDS, mutated


def _lazy(pid):
    key, dtype, numel = storage_pid(pid, "f.pkl")
    return typed_storage(StorageRef(key, dtype, numel), dtype)


def _data_pkl(path: Path) -> bytes | None:
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            return zf.read(names[0]) if len(names) == 1 else None
    except zipfile.BadZipFile:
        return None


ARCHIVES = sorted(
    p
    for p in (ROOT / "fixtures").rglob("*")
    if p.suffix in (".pt", ".bin", ".pth", ".ckpt") and p.is_file() and _data_pkl(p) is not None
)


def machine(data: bytes):
    return restricted_loads(data, "f.pkl", _lazy)


def _road(data: bytes):
    return safeload_torchsave.load(data, _lazy)


def _same_or_declined(data: bytes) -> bool:
    return same_or_declined(_road, machine, data)


def test_the_fixture_archives_take_the_fast_road_and_equal_the_machine():
    """Every archive the machine reads, but those holding numpy values (RNG states: the machine's
    own road), takes the fast road and gives the very same value."""
    assert len(ARCHIVES) >= 300
    taken, numpy = 0, 0
    for path in ARCHIVES:
        data = _data_pkl(path)
        try:
            machine(data)
        except CkptkitError:
            assert safeload_torchsave.load(data, _lazy) is None, path
            continue
        if b"numpy" in data:
            numpy += 1
            continue
        assert _same_or_declined(data), f"{path}: declined"
        taken += 1
    assert taken >= 300 and numpy < taken // 10


@FUZZ
@given(st.data())
def test_opcode_mutations_of_a_torch_save_are_declined_or_equal(data):
    _same_or_declined(data.draw(mutated(SEEDS["torch_save"][0])))


@FUZZ
@given(st.data())
def test_opcode_mutations_of_a_deepspeed_optimizer_are_declined_or_equal(data):
    _same_or_declined(data.draw(mutated(SEEDS["deepspeed_optimizer"][0])))


# ---- attacks -------------------------------------------------------------------------------------


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _tensor(size: int = 4) -> bytes:
    """_rebuild_tensor_v2(storage '0' of `size` floats, 0, (size,), (1,), False, OrderedDict())."""
    pid = (
        b"("
        + _text("storage")
        + _global("torch", "FloatStorage")
        + _text("0")
        + _text("cpu")
        + b"K"
        + bytes([size])
        + b"tQ"
    )
    return (
        _global("torch._utils", "_rebuild_tensor_v2")
        + b"("
        + pid
        + b"K\x00K"
        + bytes([size])
        + b"\x85K\x01\x85"
        + b"\x89"
        + _global("collections", "OrderedDict")
        + b")Rt"
        + b"R"
    )


def test_a_plain_tensor_pickle_is_taken():
    """Control for the attacks below: the same opcodes without the attack load on both roads."""
    data = b"\x80\x02}(" + _text("w") + _tensor() + b"u."
    fast = safeload_torchsave.load(data, _lazy)
    assert isinstance(fast["w"], TensorRef) and fast == machine(data)


def test_build_cannot_change_a_tensor_ref():
    """A frozen dataclass's __dict__ is what pickle's BUILD writes: a TensorRef refuses a state."""
    data = b"\x80\x02}(" + _text("w") + _tensor() + b"}" + _text("size") + b"K\x09\x85sb" + b"u."
    assert safeload_torchsave.load(data, _lazy) is None
    with pytest.raises(CkptkitError):
        machine(data)


def test_build_cannot_change_a_storage_type():
    """torch.FloatStorage is one object for the whole process: a slots state would change its dtype."""
    data = (
        b"\x80\x02" + _global("torch", "FloatStorage") + b"N}" + _text("dtype") + _global("torch", "int8") + b"s\x86b."
    )
    assert safeload_torchsave.load(data, _lazy) is None
    from ckptkit.safeload.grammar import table

    assert table()[0][("torch", "FloatStorage")].dtype == DType("float32")


@pytest.mark.parametrize("attr", ["keys", "items", "__class__", "update"])
def test_an_ordered_dict_keeps_its_own_attributes(attr):
    data = b"\x80\x02" + _global("collections", "OrderedDict") + b")R}" + _text(attr) + b"Nsb."
    assert safeload_torchsave.load(data, _lazy) is None


def test_torch_state_dict_metadata_attribute_is_taken():
    data = b"\x80\x02" + _global("collections", "OrderedDict") + b")R}" + _text("_metadata") + b"}sb."
    fast = safeload_torchsave.load(data, _lazy)
    assert type(fast) is collections.OrderedDict and fast._metadata == {} and fast == machine(data)


def _declined_quickly(data: bytes, max_bytes: int = 256 << 20) -> None:
    declined_quickly(_road, data, max_bytes)


def test_a_list_that_contains_itself_is_declined():
    _declined_quickly(b"\x80\x02]q\x00h\x00a.")


def test_lists_sharing_their_children_are_declined():
    """Each list holds the previous one twice: 2**40 values when walked, 1 KB of pickle."""
    body = b"]q\x00K\x01a"
    for i in range(1, 40):
        body += b"]q" + bytes([i]) + (b"h" + bytes([i - 1]) + b"a") * 2
    _declined_quickly(b"\x80\x02" + body + b".")


def test_deep_nesting_is_declined():
    _declined_quickly(b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b".", max_bytes=64 << 20)


def test_a_memo_index_past_the_input_is_declined_before_unpickling():
    _declined_quickly(b"\x80\x02Nr" + struct.pack("<I", 0x7FFFFFFF) + b".", max_bytes=16 << 20)


@pytest.mark.parametrize(
    "module,name",
    [
        ("os", "system"),
        ("numpy", "dtype"),
        ("builtins", "set"),
        ("copyreg", "_reconstructor"),
        ("_codecs", "encode"),
        ("pathlib", "PosixPath"),
    ],
)
def test_globals_outside_the_road_are_declined(module, name):
    data = b"\x80\x02" + _global(module, name) + _text("x") + b"\x85R."
    assert safeload_torchsave.load(data, _lazy) is None


def test_load_structure_takes_the_fast_road(monkeypatch):
    """Control: a lazy torch.save read goes through the fast road (None would mean the machine)."""
    from ckptkit.runner.torch_archive import load_structure, open_archive
    from ckptkit.storage.source import LocalSource

    path = ROOT / "fixtures" / "data" / "plain_state_dict.pt"
    calls = []
    real = safeload_torchsave.load
    monkeypatch.setattr(safeload_torchsave, "load", lambda data, pl: calls.append(1) or real(data, pl))
    archive = open_archive(LocalSource(str(path.parent)), path.name)
    value = load_structure(archive)
    assert calls == [1] and value == machine(_data_pkl(path))
