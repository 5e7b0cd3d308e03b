"""No checkpoint can run code: hostile pickles are refused wherever they hide.

Each payload's __reduce__ calls os.system / subprocess.call / eval / exec to create a MARKER file
(absolute path in tmp_path). Planted (a) as the whole DCP .metadata, (b) nested inside a real
torch Metadata object, (c) inside a DCP bytes item's torch.save archive, (d) as data.pkl of a
torch.save .pt file (and a few more places). Every command must exit non-zero with one sentence
naming the file and the refused global, print no traceback, and never create the MARKER.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import subprocess
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from ckptkit.errors import CkptkitError, FormatError, UnsafePickleError
from ckptkit.runner.torch_archive import load_bytes_archive
from ckptkit.safeload import restricted_loads
from ckptkit.safeload import realize
from helpers.corrupt import (
    EXIT_ERROR,
    EXIT_PROBLEMS,
    append_bytes,
    copy_fixture,
    leftovers,
    load_md,
    replace_storage,
    run_cli,
    run_subprocess,
    save_md,
    storage_key,
    torch_save_bytes,
)


# ---- payloads ---------------------------------------------------------------------------------


class EvilSystem:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class EvilSubprocess:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (subprocess.call, (["touch", self.marker],))


class EvilEval:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.eval, (f"open({self.marker!r}, 'w').close()",))


class EvilExec:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


PAYLOADS = {
    # name: (class, globals the refusal may name). torch.save pickles with protocol 2, whose
    # fix_imports writes Python 2 names (subprocess.call -> commands.call, builtins -> __builtin__):
    # the refusal names the global as the file spells it.
    "os.system": (EvilSystem, ("posix.system", "os.system")),
    "subprocess.call": (EvilSubprocess, ("subprocess.call", "commands.call")),
    "builtins.eval": (EvilEval, ("builtins.eval", "__builtin__.eval")),
    "builtins.exec": (EvilExec, ("builtins.exec", "__builtin__.exec")),
}


def evil(kind: str, marker: Path):
    return PAYLOADS[kind][0](str(marker))


@pytest.mark.parametrize("kind", list(PAYLOADS))
def test_payloads_are_live(kind, tmp_path):
    """Control: plain pickle really runs each payload (so the refusals below mean something)."""
    marker = tmp_path / "CONTROL"
    pickle.loads(pickle.dumps(evil(kind, marker)))
    assert marker.exists()


# ---- where the payload hides -------------------------------------------------------------------


def plant_whole_metadata(tmp_path: Path, kind: str, marker: Path) -> tuple[Path, str]:
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    (d / ".metadata").write_bytes(pickle.dumps(evil(kind, marker)))
    return d, ".metadata"


def plant_in_metadata_planner_data(tmp_path: Path, kind: str, marker: Path) -> tuple[Path, str]:
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    md.planner_data["evil"] = evil(kind, marker)
    save_md(d, md)
    return d, ".metadata"


def plant_in_storage_info(tmp_path: Path, kind: str, marker: Path) -> tuple[Path, str]:
    """Deep inside Metadata: the relative_path of one storage record is the payload."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    replace_storage(md, storage_key(md, "model.pos", (0, 0)), relative_path=evil(kind, marker))
    save_md(d, md)
    return d, ".metadata"


def plant_in_rank_local_metadata(tmp_path: Path, kind: str, marker: Path) -> tuple[Path, str]:
    d = copy_fixture("dcp_rank_local_w2", tmp_path, "ckpt")
    md = load_md(d, "__1.metadata")
    md.planner_data["evil"] = evil(kind, marker)
    save_md(d, md, "__1.metadata")
    return d, "__1.metadata"


def plant_in_bytes_item(tmp_path: Path, kind: str, marker: Path) -> tuple[Path, str]:
    """A DCP bytes item (extra.note) re-pointed at a torch.save of a dict holding the payload."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    mi = storage_key(md, "extra.note")
    info = md.storage_data[mi]
    blob = torch_save_bytes({"note": "hello", "evil": evil(kind, marker)})
    offset = append_bytes(d / info.relative_path, blob)
    replace_storage(md, mi, offset=offset, length=len(blob))
    save_md(d, md)
    return d, info.relative_path


def plant_in_tensor_item(tmp_path: Path, kind: str, marker: Path) -> tuple[Path, str]:
    """A DCP tensor chunk whose torch.save archive pickles the payload instead of a tensor."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    mi = storage_key(md, "model.pos", (0, 0))
    info = md.storage_data[mi]
    blob = torch_save_bytes(evil(kind, marker))
    offset = append_bytes(d / info.relative_path, blob)
    replace_storage(md, mi, offset=offset, length=len(blob))
    save_md(d, md)
    return d, info.relative_path


def plant_in_pt(tmp_path: Path, kind: str, marker: Path) -> tuple[Path, str]:
    p = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "evil": evil(kind, marker)}, p)
    return p, "evil.pt"


def plant_in_pt_in_folder(tmp_path: Path, kind: str, marker: Path) -> tuple[Path, str]:
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save({"model": {"w": torch.ones(3)}, "extra": [1, evil(kind, marker)]}, d / "model.bin")
    return d, "model.bin"


def plant_in_pt_without_suffix(tmp_path: Path, kind: str, marker: Path) -> tuple[Path, str]:
    """Detected by zip magic, not by name."""
    p = tmp_path / "weights.data"
    torch.save({"w": torch.ones(3), "evil": evil(kind, marker)}, p)
    return p, "weights.data"


PLACES = {
    "whole_metadata": plant_whole_metadata,
    "metadata_planner_data": plant_in_metadata_planner_data,
    "metadata_storage_info": plant_in_storage_info,
    "rank_local_metadata": plant_in_rank_local_metadata,
    "dcp_bytes_item": plant_in_bytes_item,
    "dcp_tensor_item": plant_in_tensor_item,
    "pt_data_pkl": plant_in_pt,
    "pt_in_folder": plant_in_pt_in_folder,
    "pt_no_suffix": plant_in_pt_without_suffix,
}

COMMANDS = ["inspect", "inspect --json", "verify --deep", "consolidate", "reshard"]


def run_command(cmd: str, src: Path, tmp_path: Path, runner=run_cli):
    out = tmp_path / "OUT"
    if cmd == "consolidate":
        return runner("consolidate", str(src), str(out)), out
    if cmd == "reshard":
        return runner("reshard", str(src), str(out), "--to", "3"), out
    return runner(*cmd.split(), str(src)), None


def assert_refused(res, file: str, kind: str, marker: Path, cmd: str, out: Path | None) -> None:
    detail = f"exit {res.code}\n--- stdout ---\n{res.stdout}\n--- stderr ---\n{res.stderr}"
    assert not marker.exists(), f"PAYLOAD RAN: {marker} was created\n{detail}"
    assert res.exception is None, f"uncaught {res.exception!r}\n{detail}"
    assert "Traceback" not in res.output, detail
    if cmd.startswith("verify"):
        assert res.code == EXIT_PROBLEMS, detail
        text = "\n".join(res.stderr.splitlines()[1:])
    else:
        assert res.code == EXIT_ERROR, detail
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), detail
        text = lines[0]
    assert file in text, f"message does not name {file}\n{detail}"
    assert any(g in text for g in PAYLOADS[kind][1]), f"message does not name the refused global\n{detail}"
    assert "nothing was executed" in text or "refus" in text, detail
    if out is not None:
        assert not out.exists(), detail
        assert leftovers(out) == [], detail


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("kind", list(PAYLOADS))
@pytest.mark.parametrize("place", list(PLACES))
def test_hostile_pickle_refused(place, kind, cmd, tmp_path):
    marker = tmp_path / "MARKER"
    src, file = PLACES[place](tmp_path, kind, marker)
    res, out = run_command(cmd, src, tmp_path)
    assert_refused(res, file, kind, marker, cmd, out)


@pytest.mark.parametrize(
    "place,cmd", [("whole_metadata", "reshard"), ("dcp_bytes_item", "verify --deep"), ("pt_data_pkl", "consolidate")]
)
def test_hostile_pickle_refused_end_to_end(place, cmd, tmp_path):
    """Through a real interpreter (python -m ckptkit), with the payload that shells out."""
    marker = tmp_path / "MARKER"
    src, file = PLACES[place](tmp_path, "os.system", marker)
    res, out = run_command(cmd, src, tmp_path, runner=run_subprocess)
    assert_refused(res, file, "os.system", marker, cmd, out)


@pytest.mark.parametrize("place", ["whole_metadata", "metadata_planner_data", "dcp_bytes_item", "pt_data_pkl"])
def test_open_checkpoint_raises_unsafe_pickle(place, tmp_path):
    """The library API (not only the CLI) raises UnsafePickleError and runs nothing."""
    from ckptkit.formats.registry import open_checkpoint

    marker = tmp_path / "MARKER"
    src, file = PLACES[place](tmp_path, "os.system", marker)
    with pytest.raises(UnsafePickleError) as info:
        open_checkpoint(str(src))
    assert file in str(info.value)
    assert not marker.exists()


# ---- restricted_loads directly -----------------------------------------------------------------

ALLOWED_VALUES = {
    "od": OrderedDict([("a", 1), ("b", [1.5, None, True])]),
    "set": {1, 2, 3},
    "frozenset": frozenset({"x"}),
    "size": torch.Size([2, 3]),
    "dtype": torch.bfloat16,
    "device": torch.device("cpu"),
    "slice": slice(1, 5, 2),
    "complex": 1 + 2j,
    "bytes": b"\x00\x01\xff",
    "bytearray": bytearray(b"ab"),
    "range": range(3),
    "tuple": (1, ("nested", 2.0)),
    "str": "text",
    "path": "ignored",
}


def test_allowed_values_round_trip():
    value = dict(ALLOWED_VALUES)
    for protocol in (3, 4, pickle.HIGHEST_PROTOCOL):
        # torch's types come back as ckptkit's stand-ins, which realize() turns into torch's own
        assert realize(restricted_loads(pickle.dumps(value, protocol=protocol), "mem")) == value


def _p2_value(name):
    import numpy as np

    if name == "numpy_array":
        return np.arange(6, dtype=np.float32).reshape(2, 3)
    if name == "numpy_rng_state":
        return np.random.RandomState(0).get_state()
    return ALLOWED_VALUES[name]


def _p2_params():
    names = [n for n in ALLOWED_VALUES if n != "path"] + ["numpy_array", "numpy_rng_state"]
    return names


@pytest.mark.parametrize("name", _p2_params())
def test_torch_save_values_round_trip(name):
    """Values torch.save writes (pickle protocol 2) in real checkpoints load back unchanged."""
    import numpy as np

    value = _p2_value(name)
    loaded = realize(load_bytes_archive(torch_save_bytes({"w": torch.ones(2), "v": value}), "mem.pt"))
    assert torch.equal(loaded["w"], torch.ones(2))
    if name == "numpy_array":
        assert isinstance(loaded["v"], np.ndarray) and np.array_equal(loaded["v"], value)
    elif name == "numpy_rng_state":
        assert loaded["v"][0] == value[0] and np.array_equal(loaded["v"][1], value[1])
    else:
        assert loaded["v"] == value


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8, torch.float64]
)
def test_tensors_round_trip_through_torch_save_archive(dtype):
    base = (torch.arange(24) % 7).to(dtype).reshape(4, 6)
    state = {
        "w": base,
        "t": base.t(),  # non-contiguous view of the same storage
        "row": base[2],  # storage offset
        "p": torch.nn.Parameter(base.clone().float(), requires_grad=False) if dtype.is_floating_point else base,
        "scalar": torch.tensor(3, dtype=dtype),
        "empty": torch.empty(0, 5, dtype=dtype),
        "nested": OrderedDict(list=[base[0], 5], step=7),
    }
    loaded = realize(load_bytes_archive(torch_save_bytes(state), "mem.pt"))
    for key in ("w", "t", "row", "scalar", "empty"):
        assert loaded[key].dtype == dtype, key
        assert torch.equal(loaded[key], state[key]), key
    assert torch.equal(loaded["p"], state["p"])
    assert torch.equal(loaded["nested"]["list"][0], base[0])
    assert loaded["nested"]["list"][1] == 5 and loaded["nested"]["step"] == 7


def test_plain_pickled_tensor_is_refused():
    """pickle.dumps(tensor) rebuilds its storage through torch.load: not on the allowlist."""
    with pytest.raises(UnsafePickleError, match="mem.pkl"):
        restricted_loads(pickle.dumps(torch.ones(3)), "mem.pkl")


@pytest.mark.parametrize("kind", list(PAYLOADS))
@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_evil_refused(kind, protocol, tmp_path):
    marker = tmp_path / "MARKER"
    data = pickle.dumps({"a": [1, evil(kind, marker)]}, protocol=protocol)
    with pytest.raises(UnsafePickleError) as info:
        restricted_loads(data, "some/file.pkl")
    msg = str(info.value)
    assert "some/file.pkl" in msg
    assert any(g in msg for g in PAYLOADS[kind][1]), msg
    assert not marker.exists()
    assert isinstance(info.value, CkptkitError)


@pytest.mark.parametrize(
    "module,name",
    [
        ("os", "system"),
        ("posix", "system"),
        ("subprocess", "Popen"),
        ("builtins", "getattr"),
        ("builtins", "__import__"),
        ("builtins", "open"),
        ("torch", "load"),
        ("torch.storage", "_load_from_bytes"),
        ("torch._utils", "_rebuild_device_tensor_from_numpy"),
        ("numpy", "load"),
        ("pickle", "loads"),
        ("copyreg", "_reconstructor_evil"),
        ("shutil", "rmtree"),
        ("torch.distributed.checkpoint.metadata", "os"),
    ],
)
def test_arbitrary_globals_refused(module, name):
    """GLOBAL opcode for anything off the allowlist, called or not, is refused."""
    data = b"c" + module.encode() + b"\n" + name.encode() + b"\n."
    with pytest.raises(UnsafePickleError, match=f"{module}.{name}"):
        restricted_loads(data, "f.pkl")
    data = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00" + _short(module) + _short(name) + b"\x93."
    with pytest.raises(UnsafePickleError):
        restricted_loads(data, "f.pkl")


def _short(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


@pytest.mark.parametrize(
    "cls,base",
    [
        ("collections\nOrderedDict", "__builtin__\nset"),
        ("builtins\nset", "builtins\nfrozenset"),
        ("torch\nSize", "__builtin__\nset"),
    ],
)
def test_reconstructor_cannot_build_arbitrary_class(cls, base):
    """copyreg._reconstructor is allowed only for inert stand-ins over object: pointing it at
    another allowed class (OrderedDict, set, torch.Size) is refused, naming the file."""
    data = f"ccopyreg\n_reconstructor\n(c{cls}\nc{base}\nNtR.".encode()
    with pytest.raises(UnsafePickleError) as info:
        restricted_loads(data, "f.pkl")
    assert "f.pkl" in str(info.value)


@pytest.mark.parametrize(
    "cls,base", [("collections\nOrderedDict", "__builtin__\nset"), ("torch\nSize", "__builtin__\nset")]
)
def test_reconstructor_refusal_runs_nothing(cls, base):
    data = f"ccopyreg\n_reconstructor\n(c{cls}\nc{base}\nNtR.".encode()
    with pytest.raises(UnsafePickleError):
        restricted_loads(data, "f.pkl")


def test_unknown_layout_names_file():
    data = b"ctorch.serialization\n_get_layout\n(Vos.system\ntR."
    with pytest.raises(UnsafePickleError) as info:
        restricted_loads(data, "f.pkl")
    assert "f.pkl" in str(info.value)


def test_rebuild_from_type_v2_refuses_foreign_function(tmp_path):
    """torch._tensor._rebuild_from_type_v2 is allowed, but only with our tensor rebuilders."""
    marker = tmp_path / "MARKER"

    class Sneaky:
        def __reduce__(self):
            import torch._tensor as tt

            return (tt._rebuild_from_type_v2, (os.system, torch.Tensor, (f"touch {marker}",), {}))

    with pytest.raises(UnsafePickleError):
        restricted_loads(pickle.dumps(Sneaky()), "f.pkl")
    assert not marker.exists()


def test_rebuild_from_type_v2_refusal_names_file():
    import torch._tensor as tt

    class Sneaky:  # an allowed callable (torch.Size) that is not one of our tensor rebuilders
        def __reduce__(self):
            return (tt._rebuild_from_type_v2, (torch.Size, torch.Tensor, ((1,),), {}))

    with pytest.raises(UnsafePickleError) as info:
        restricted_loads(pickle.dumps(Sneaky()), "f.pkl")
    assert "f.pkl" in str(info.value)


def test_persistent_id_outside_archive_is_format_error():
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", "x") if obj == "ref" else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"a": "ref"})
    with pytest.raises(FormatError, match="f.pkl"):
        restricted_loads(buf.getvalue(), "f.pkl")


@pytest.mark.parametrize("data", [b"", b"\x80", b"\x80\x02}q\x00(", b"garbage", b"\x80\x05\x95" + b"\xff" * 8])
def test_malformed_pickle_is_format_error(data):
    with pytest.raises(FormatError, match="f.pkl"):
        restricted_loads(data, "f.pkl")


N_DEEP = 200_000


def deep_list_pickle(n: int = N_DEEP) -> bytes:
    """[[[[...]]]] n levels deep, written opcode by opcode (pickle.dumps itself would recurse)."""
    return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."


def deep_dict_pickle(n: int = N_DEEP) -> bytes:
    """{"k": {"k": {...}}} n levels deep."""
    return b"\x80\x02}" + b"X\x01\x00\x00\x00k}" * n + b"s" * n + b"."


@pytest.mark.parametrize("make", [deep_list_pickle, deep_dict_pickle])
def test_deeply_nested_pickle_no_recursion_error(make):
    """Either a value or FormatError, never a RecursionError escaping restricted_loads."""
    try:
        restricted_loads(make(), "deep.pkl")
    except FormatError as exc:
        assert "deep.pkl" in str(exc)
    except RecursionError:  # pragma: no cover - the failure this test guards against
        pytest.fail("RecursionError escaped restricted_loads")


def test_recursion_error_becomes_format_error(monkeypatch):
    """When unpickling does recurse too deeply, the caller gets FormatError naming the file."""
    import ckptkit.safeload as sl

    def boom(self):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(sl._RestrictedUnpickler, "load", boom)
    with pytest.raises(FormatError, match="deep.pkl.*nested too deeply"):
        restricted_loads(b"\x80\x02N.", "deep.pkl")


def _pt_with_data_pkl(path: Path, data_pkl: bytes) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/version", "3\n")


def _deep_state_dict_pickle(n: int = N_DEEP) -> bytes:
    """{"w": [[[...]]]} with the list n levels deep."""
    return b"\x80\x02}X\x01\x00\x00\x00w" + b"]" * n + b"a" * (n - 1) + b"s."


def _self_referencing_pickle() -> bytes:
    loop: list = []
    loop.append(loop)
    return pickle.dumps({"w": loop}, protocol=2)


@pytest.mark.parametrize("cmd", ["inspect", "verify --deep", "consolidate"])
def test_deeply_nested_pt_is_format_error(cmd, tmp_path):
    src = tmp_path / "deep.pt"
    _pt_with_data_pkl(src, _deep_state_dict_pickle())
    res, out = run_command(cmd, src, tmp_path)
    _assert_clean_error(res, cmd, "deep.pt", out)


@pytest.mark.parametrize("cmd", ["inspect", "verify --deep", "consolidate"])
def test_self_referencing_pt_is_format_error(cmd, tmp_path):
    src = tmp_path / "loop.pt"
    _pt_with_data_pkl(src, _self_referencing_pickle())
    res, out = run_command(cmd, src, tmp_path)
    _assert_clean_error(res, cmd, "loop.pt", out)


@pytest.mark.parametrize("cmd", ["inspect", "inspect --json", "verify --deep", "consolidate", "reshard"])
def test_deeply_nested_dcp_bytes_item(cmd, tmp_path):
    """A DCP bytes item holding a 200000-deep list: no RecursionError / internal error."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    mi = storage_key(md, "extra.note")
    info = md.storage_data[mi]
    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", deep_list_pickle())
        zf.writestr("archive/version", "3\n")
    offset = append_bytes(d / info.relative_path, blob.getvalue())
    replace_storage(md, mi, offset=offset, length=len(blob.getvalue()))
    save_md(d, md)
    res, out = run_command(cmd, d, tmp_path)
    detail = f"exit {res.code}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    assert "Traceback" not in res.output and "internal error" not in res.output, detail
    assert res.exception is None, detail
    if res.code != 0:  # refusing is fine, but cleanly and naming the file
        _assert_clean_error(res, cmd, info.relative_path, out)


def _assert_clean_error(res, cmd: str, file: str, out: Path | None) -> None:
    detail = f"exit {res.code}\n--- stdout ---\n{res.stdout[-2000:]}\n--- stderr ---\n{res.stderr[-2000:]}"
    assert res.exception is None, detail
    assert "Traceback" not in res.output and "internal error" not in res.output, detail
    if cmd.startswith("verify"):
        assert res.code == EXIT_PROBLEMS, detail
    else:
        assert res.code == EXIT_ERROR, detail
        assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1, detail
    assert file in res.stderr, detail
    if out is not None:
        assert not out.exists() and leftovers(out) == [], detail
