"""The restricted unpickler accepts DATA ONLY, within limits; JSON from a checkpoint is bounded too.

Four classes of attack, each crafted here as an attacker would (pickle opcodes, numpy states,
torch.save archives planted into real DCP checkpoints), each first as one concrete instance
and then as its class:

1. memory corruption through state: numpy rebuilt through BUILD / __setstate__ (a structured
   dtype whose field lies past the item crashed `verify`, `inspect` and `Checkpointer.restore`);
   BUILD on anything but ckptkit's stand-ins (interned dtypes, classes, containers) is refused;
2. amplification: `bytearray(1.5e9)` in a 37-byte .metadata, declared lengths past the input,
   set(range(10**12)), numpy shapes larger than their bytes ...;
3. expansion: 40 nested lists sharing their children (memo GET) expand to 2**40 values; shared
   parts count each time they are reached, so such a pickle is refused while it loads; depth too;
4. JSON nested 1e5 deep in a safetensors header, an index.json, a __metadata__ value, a
   --ds-config.

CLI cases run through tests/helpers/hostile.py: exit 2, one sentence naming the file, no traceback, peak
RSS under the bound, within the timeout, the source byte-identical.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import struct
import time
import tracemalloc
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import hostile
from ckptkit import knobs, safe_json
from ckptkit.errors import CkptkitError, FormatError, UnsafePickleError, UsageError
from ckptkit.runner.torch_archive import load_bytes_archive
from ckptkit.safeload import restricted_loads
from ckptkit.torch_types import DType
from conftest import ROOT
from helpers.corrupt import append_bytes, copy_fixture, load_md, replace_storage, save_md, storage_key

try:
    from numpy._core.multiarray import _reconstruct, scalar
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _reconstruct, scalar

TIMEOUT = 60.0
RSS = hostile.rss_bound(knobs.MEMORY_BUDGET, 0)


# ---- crafting ---------------------------------------------------------------------------------


class Call:
    """Pickles as `func(*args)`, then BUILD with `state` when one is given: any call an attacker
    wants to write, through pickle's own pickler (the global is written as func's module.name)."""

    def __init__(self, func, args=(), state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def dtype_state(fields: dict | None, itemsize: int, flags: int, names=None) -> tuple:
    return (3, "|", None, names or (tuple(fields) if fields else None), fields, itemsize, 1, flags)


def structured_array(field_dtype: str = "O", offset: int = 1_000_000) -> Call:
    """A one-item numpy array of an 8-byte structured dtype whose one field lies `offset` bytes
    into the item: numpy's own __setstate__ accepts it and then writes an object pointer (an
    object field, whose data pickles as a list) or reads an int64 outside the item: on main,
    `ckptkit inspect` died of SIGSEGV on both (exit 139)."""
    flags = 63 if field_dtype == "O" else 16
    bad = Call(np.dtype, ("V8", False, True), dtype_state({"a": (np.dtype(field_dtype), offset)}, 8, flags))
    data = [(1,)] if field_dtype == "O" else b"\0" * 8
    return Call(_reconstruct, (np.ndarray, (0,), b"b"), (1, (1,), bad, False, data))


def torch_save_blob(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def archive_of(data_pkl: bytes) -> bytes:
    """A torch.save archive whose data.pkl is `data_pkl` (crafted opcode by opcode)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/version", "3\n")
    return buf.getvalue()


def plant_bytes_item(tmp_path: Path, blob: bytes, name: str = "ckpt") -> tuple[Path, str]:
    """A copy of a real DCP checkpoint whose bytes item `extra.note` holds `blob`; the data file."""
    d = copy_fixture("fsdp2_w2", tmp_path, name)
    md = load_md(d)
    mi = storage_key(md, "extra.note")
    info = md.storage_data[mi]
    offset = append_bytes(d / info.relative_path, blob)
    replace_storage(md, mi, offset=offset, length=len(blob))
    save_md(d, md)
    return d, info.relative_path


def op_long(n: int) -> bytes:
    raw = n.to_bytes((n.bit_length() + 8) // 8 or 1, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def op_str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def get(k: int) -> bytes:
    return b"j" + struct.pack("<I", k)


def put(k: int) -> bytes:
    return b"r" + struct.pack("<I", k)


def shared_lists(levels: int = 40) -> bytes:
    """L0 = []; L(k) = [L(k-1), L(k-1)] through the memo: 17 bytes a level, 2**levels values."""
    out = b"\x80\x02]" + put(0)
    for k in range(1, levels + 1):
        out += b"]" + put(k) + b"(" + get(k - 1) + get(k - 1) + b"e"
    return out + b"."


def in_dict(value_ops: bytes) -> bytes:
    """{"v": <value>} around a value written by `value_ops` (no PROTO, no STOP)."""
    return b"\x80\x02}" + op_str("v") + value_ops + b"s."


def loads(data: bytes, file: str = "f.pkl", **kw):
    return restricted_loads(data, file, **kw)


def refused(
    data: bytes,
    *words: str,
    kind: type = CkptkitError,
    file: str = "f.pkl",
    max_bytes: int = 32 << 20,
    max_seconds: float = 2.0,
) -> str:
    """restricted_loads refuses `data` with `kind`, naming the file and `words`, allocating at
    most `max_bytes` (tracemalloc) and within `max_seconds`; the message."""
    start = time.process_time()  # CPU time: the bound is the unpickler's work, not the machine's load
    with pytest.raises(kind) as info:
        restricted_loads(data, file)
    seconds = time.process_time() - start
    tracemalloc.start()
    try:
        with pytest.raises(kind):
            restricted_loads(data, file)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert msg.startswith(f"{file}: "), msg
    for w in words:
        assert w in msg, msg
    assert "\n" not in msg, msg
    assert peak <= max_bytes, f"allocated {peak / 2**20:.0f} MB refusing: {msg}"
    assert seconds <= max_seconds, f"took {seconds:.1f} s refusing: {msg}"
    return msg


def cli_refused(*args, source: Path, names: tuple[str, ...], out: Path | None = None, code: int = 2):
    scene = hostile.Scene(source, out)
    run = hostile.run_ckptkit(*args, timeout=TIMEOUT)
    hostile.check_refused(run, *names, scene=scene, code=code, rss_limit=RSS)
    return run


# ---- 1. state: numpy and BUILD ----------------------------------------------------------------


def test_structured_dtype_payload_is_live():
    """Control: numpy's own unpickler accepts the crafted dtype (a field 1 MB past an 8-byte item)."""
    value = pickle.loads(
        pickle.dumps(Call(np.dtype, ("V8", False, True), dtype_state({"a": (np.dtype("i8"), 1_000_000)}, 8, 16)))
    )
    assert value.fields["a"][1] == 1_000_000 > value.itemsize


@pytest.mark.parametrize("field", ["O", "i8"])
@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_structured_dtype_in_dcp_bytes_item_refused(cmd, field, tmp_path):
    """The instance: 1.5 KB DCP bytes item; object field crashed (SIGSEGV), int64 printed heap."""
    blob = torch_save_blob({"note": "hello", "v": structured_array(field)})
    assert len(blob) < 2048
    src, rel = plant_bytes_item(tmp_path, blob)
    if cmd == "inspect":
        cli_refused("inspect", src, source=src, names=(rel,))
    else:  # verify reports the item among its problems (exit 1), never crashes
        scene = hostile.Scene(src)
        run = hostile.run_ckptkit("verify", src, timeout=TIMEOUT)
        assert run.code in (1, 2), run.detail()
        assert "Traceback" not in run.output and "internal error" not in run.output, run.detail()
        assert rel in run.stderr and "numpy" in run.stderr, run.detail()
        assert run.peak_rss <= RSS and scene.source_unchanged(), run.detail()


_RESTORE = """
import sys, warnings, torch, ckptkit
warnings.filterwarnings("ignore")
from ckptkit.errors import CkptkitError
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
ck = ckptkit.Checkpointer(sys.argv[1])
if sys.argv[2] == "save":
    ck.save(1, model, extra={"note": "hello"})
    sys.exit(0)
try:
    ck.restore(model)
except CkptkitError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
print("restored", ck.extra)
"""


def test_structured_dtype_refused_by_checkpointer_restore(tmp_path):
    """Checkpointer.restore of a step whose `extra` item (and marker) an attacker rewrote."""
    from ckptkit.hooks.steps import MARKER

    root = tmp_path / "ckpts"
    saved = hostile.run_python(["-c", _RESTORE, str(root), "save"], timeout=120)
    assert saved.code == 0, saved.detail()
    (step,) = [p for p in root.iterdir() if p.is_dir()]
    md = load_md(step)
    mi = storage_key(md, "extra.note")
    info = md.storage_data[mi]
    blob = torch_save_blob({"v": structured_array("O")})
    offset = append_bytes(step / info.relative_path, blob)
    replace_storage(md, mi, offset=offset, length=len(blob))
    save_md(step, md)
    marker = json.loads((step / MARKER).read_text())
    marker["files"] = {rel: (step / rel).stat().st_size for rel in marker["files"]}
    (step / MARKER).write_text(json.dumps(marker))
    scene = hostile.Scene(root)
    run = hostile.run_python(["-c", _RESTORE, str(root), "restore"], timeout=120)
    hostile.check_refused(run, info.relative_path, "numpy", scene=scene, rss_limit=RSS)


def test_structured_dtype_refused_by_ckptkit_load(tmp_path):
    import ckptkit

    src, rel = plant_bytes_item(tmp_path, torch_save_blob({"v": structured_array("O")}))
    with pytest.raises(CkptkitError) as info:
        ckptkit.load({"extra": {"note": None}}, str(src))
    assert rel in str(info.value)


@pytest.mark.parametrize(
    "spec,state",
    [
        ("V8", dtype_state({"a": (np.dtype("O"), 0)}, 8, 63)),  # structured, object field
        ("V8", dtype_state({"a": (np.dtype("<i8"), 3)}, 16, 16)),  # unaligned field offset
        ("V16", dtype_state(None, 16, 0)),  # void
        ("O8", (3, "|", None, None, None, -1, -1, 63)),  # object
        ("U3", (3, "<", None, None, None, 12, 4, 8)),  # unicode
        ("M8", (4, "<", None, None, None, -1, -1, 0, (None, (b"s", 1, 1, 1)))),  # datetime
        ("f8", (3, "<", ((np.dtype("f8"), (1000000,)),), None, None, -1, -1, 0)),  # subarray in the state
        ("f8", (3, "<", None, ("a",), {"a": (np.dtype("f8"), 0)}, -1, -1, 0)),  # fields added by state
        ("f8", (3, "<", None, None, None, 4096, -1, 0)),  # item size other than 8
        ("f8", (3, "<", None, None, None, -1, -1, 63)),  # object flags on a float
    ],
)
def test_numpy_dtypes_other_than_plain_are_refused(spec, state):
    msg = refused(pickle.dumps(Call(np.dtype, (spec, False, True), state), protocol=2))
    assert "numpy" in msg or "dtype" in msg


@pytest.mark.parametrize(
    "state,words",
    [
        ((1, (10**6,), np.dtype("f8"), False, b"\0" * 8), "needs 8,000,000 bytes"),  # shape past its bytes
        ((1, (2**40, 2**40), np.dtype("u1"), False, b""), "bytes"),  # shape of 2**80 elements
        ((1, (-1,), np.dtype("f8"), False, b""), "shape"),
        ((1, (1,), np.dtype("f8"), False, [1.5]), "not a byte string"),  # object-array data
        ((1, (2,), np.dtype("?"), False, b"\x01\x02"), "bool"),  # bool bytes other than 0/1
        ((1, (1,), "f8", False, b"\0" * 8), "dtype"),
        ((1, tuple([1] * 40), np.dtype("f8"), False, b"\0" * 8), "shape"),
    ],
)
def test_numpy_array_states_are_checked(state, words):
    data = pickle.dumps(Call(_reconstruct, (np.ndarray, (0,), b"b"), state), protocol=2)
    refused(data, words)


@pytest.mark.parametrize(
    "args",
    [
        (OrderedDict, (0,), b"b"),
        (np.ndarray, (5,), b"b"),
        (np.ndarray, (0,), b"O"),
    ],
)
def test_numpy_reconstruct_only_starts_plain_arrays(args):
    refused(
        pickle.dumps(Call(_reconstruct, args, (1, (0,), np.dtype("f8"), False, b"")), protocol=2),
        "refusing to call",
        kind=UnsafePickleError,
    )


def test_numpy_array_without_its_state_is_refused():
    data = pickle.dumps({"v": Call(_reconstruct, (np.ndarray, (0,), b"b"))}, protocol=2)
    refused(data, "without its state")


@pytest.mark.parametrize(
    "args", [(np.dtype("f8"), b"\0" * 4), (np.dtype("O"), b"\0" * 8), (np.dtype("?"), b"\x07"), ("f8", b"\0" * 8)]
)
def test_numpy_scalars_need_plain_dtypes_and_their_bytes(args):
    refused(pickle.dumps(Call(scalar, args), protocol=2))


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.array([True, False]),
        np.zeros((0, 5), np.float16),
        np.array(3.5),
        np.arange(4, dtype=">i4"),
        np.float64(2.5),
        np.int8(-3),
        np.bool_(True),
        np.complex64(1 + 2j),
        np.arange(3, dtype=np.uint64),
    ],
)
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_plain_numpy_values_load_as_numpy_loads_them(value, protocol):
    data = pickle.dumps({"v": value}, protocol=protocol)
    want, got = pickle.loads(data)["v"], loads(data)["v"]
    assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    if isinstance(got, np.ndarray):
        assert got.flags.writeable and got.flags.owndata and got.flags.f_contiguous == want.flags.f_contiguous


def test_rng_states_real_trainers_write_keep_loading():
    import random

    states = {
        "np": np.random.RandomState(3).get_state(),
        "gen": np.random.default_rng(4).bit_generator.state,
        "py": random.Random(5).getstate(),
        "torch": torch.get_rng_state(),
        "step": np.int64(7),
    }
    got = load_bytes_archive(torch_save_blob(states), "rng.pt")
    assert got["np"][0] == "MT19937" and np.array_equal(got["np"][1], states["np"][1])
    assert got["gen"] == states["gen"] and got["py"] == states["py"] and got["step"] == 7
    assert got["torch"].to_torch().equal(states["torch"])


# BUILD targets that are not ckptkit's stand-ins: each pickle applies a state to one of them
_BUILD_TARGETS = {
    "dict": b"}",
    "list": b"]",
    "set": b"\x8f",
    "int": b"K\x01",
    "str": op_str("s"),
    "torch.float32 (interned dtype)": b"ctorch\nfloat32\n",
    "torch.strided (global)": b"ctorch\nstrided\n",
    "a stand-in class": b"ctorch.distributed.checkpoint.metadata\nMetadata\n",
    "torch.FloatStorage": b"ctorch\nFloatStorage\n",
    "torch.Size": b"ctorch\nSize\n(K\x02K\x03tq\x00\x85R",
    "bytearray": b"c__builtin__\nbytearray\n" + b"C\x02ab\x85R",
    "a path": b"cpathlib\nPurePosixPath\n" + op_str("/a") + b"\x85R",
    "a range": b"c__builtin__\nrange\nK\x03\x85R",
    "a function of the grammar": b"c_codecs\nencode\n",
}


@pytest.mark.parametrize("target", list(_BUILD_TARGETS))
@pytest.mark.parametrize("state", ["dict", "slots"])
def test_build_only_on_stand_ins(target, state):
    state_ops = (
        (b"}" + op_str("name") + op_str("int8") + b"s")
        if state == "dict"
        else (b"N}" + op_str("name") + op_str("int8") + b"s\x86")
    )
    data = b"\x80\x02" + _BUILD_TARGETS[target] + state_ops + b"b."
    refused(data)
    assert DType("float32").name == "float32" and DType("float32").attr == "float32"


@pytest.mark.parametrize("attr", ["_qualname", "to_data", "__class__", "__dict__", "__reduce__", "_public_state"])
def test_stand_in_state_cannot_shadow_its_own_attributes(attr):
    """e.g. _qualname set by state would make ckptkit re-emit the object as any global."""
    from ckptkit.safeload import inert_class

    data = (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}"
        + op_str(attr)
        + op_str("os.system")
        + b"sb."
    )
    refused(data, "not plain data", kind=UnsafePickleError)
    assert inert_class("torch.distributed.checkpoint.metadata.Metadata")._qualname.endswith("Metadata")


def test_ordered_dict_state_is_plain_attributes_only():
    good = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).state_dict()
    got = load_bytes_archive(torch_save_blob(good), "sd.pt")
    assert type(got) is OrderedDict and list(got) == list(good) and dict(got._metadata) == dict(good._metadata)
    bad = b"\x80\x02ccollections\nOrderedDict\n)R}" + op_str("items") + b"K\x01sb."
    refused(bad, "not plain data", kind=UnsafePickleError)


@pytest.mark.parametrize(
    "ops",
    [
        b"ctorch\nfloat32\n)R",
        b"]" + b")R",
        b"ctorch\nstrided\n)R",
        b"ctorch\nFloatStorage\n)R",
        b"ctorch\ndevice\n" + op_str("cpu") + b"\x85R)R",  # call the result of a call
    ],
)
def test_only_grammar_callables_are_called(ops):
    refused(b"\x80\x02" + ops + b".", "refusing to call", kind=UnsafePickleError)


@pytest.mark.parametrize(
    "cls",
    [
        b"c__builtin__\nset\n",
        b"ccollections\nOrderedDict\n",
        b"ctorch\nSize\n",
        b"c__builtin__\nbytearray\n",
        b"cnumpy\nndarray\n",
    ],
)
def test_newobj_only_on_stand_ins(cls):
    refused(b"\x80\x02" + cls + b")\x81.", kind=UnsafePickleError)


@pytest.mark.parametrize(
    "body,name",
    [
        (b"(icollections\nOrderedDict\n", "INST"),
        (b"(ctorch\nSize\no", "OBJ"),
        (b"\x82\x01", "EXT1"),
        (b"\x83\x01\x00", "EXT2"),
        (b"\x84\x01\x00\x00\x00", "EXT4"),
        (b"\x97", "NEXT_BUFFER"),
        (b"C\x01a\x98", "READONLY_BUFFER"),
    ],
)
def test_code_running_opcodes_are_refused(body, name):
    refused(b"\x80\x05" + body + b".", name, kind=UnsafePickleError)


def test_inst_names_an_unknown_class():
    refused(b"(ios\nsystem\n.", "os.system", kind=UnsafePickleError)


# ---- 2. amplification ------------------------------------------------------------------------


def test_bytearray_in_a_37_byte_metadata_is_refused(tmp_path):
    """The instance: DCP .metadata = bytearray(1_500_000_000), 37 bytes; allocated 1.5 GB."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    data = b"\x80\x02c__builtin__\nbytearray\nJ\x00/\x59\x59\x85R."  # bytearray(1_499_016_960)
    (d / ".metadata").write_bytes(data)
    assert len(data) < 40
    cli_refused("inspect", d, source=d, names=(".metadata", "bytearray"))


@pytest.mark.parametrize(
    "ops,words",
    [
        (b"\x8e" + struct.pack("<Q", 1_500_000_000) + b"xx", "byte string of 1,500,000,000 bytes"),  # BINBYTES8
        (b"\x8d" + struct.pack("<Q", 2**62) + b"xx", "text of"),  # BINUNICODE8
        (b"\x96" + struct.pack("<Q", 2**40) + b"xx", "byte string of"),  # BYTEARRAY8
        (b"B" + struct.pack("<I", 2**32 - 1) + b"xx", "byte string of"),  # BINBYTES
        (b"X" + struct.pack("<I", 2**31) + b"xx", "text of"),  # BINUNICODE
        (b"T" + struct.pack("<i", 2**31 - 1) + b"xx", "text of"),  # BINSTRING
        (b"\x8b" + struct.pack("<i", 2**31 - 1) + b"xx", "integer of"),  # LONG4
        (b"\x95" + struct.pack("<Q", 2**60) + b"N.", "frame of"),  # FRAME
    ],
)
def test_declared_lengths_past_the_input_are_refused_before_allocation(ops, words):
    refused(b"\x80\x05" + ops, words, kind=FormatError, max_bytes=1 << 20)


@pytest.mark.parametrize(
    "value,words",
    [
        (Call(bytearray, (1_500_000_000,)), "bytearray"),
        (Call(bytearray, (10**6 + 2**20,)), "bytearray"),
        (Call(bytes, (10**9,)), "bytes"),
        (Call(set, (range(10**12),)), "range"),
        (Call(frozenset, (range(10**12),)), "range"),
        (Call(set, ((1, 2),)), "set"),
        (Call(frozenset, ("abc",)), "frozenset"),
        (Call(range, (10**12,)), "range"),
        (Call(range, (0, 10, 0)), "range"),
        (Call(complex, ("1e999999",)), "complex"),
        (Call(complex, (1, 2, 3)), "complex"),
        (Call(slice, ("a", 1)), "slice"),
        (Call(OrderedDict, (range(10**9),)), "range"),
        (Call(OrderedDict, ({"a": 1},)), "OrderedDict"),
        (Call(OrderedDict, ([(1, 2, 3)],)), "OrderedDict"),
        (Call(__import__("_codecs").encode, ("x" * 10, "utf-8")), "encode"),
        (Call(__import__("_codecs").encode, ("x",)), "encode"),
        (Call(__import__("pathlib").PurePosixPath, (1,)), "PurePosixPath"),
        (Call(torch.Size, ("ab",)), "Size"),
        (Call(torch.Size, ((2**70,),)), "Size"),
        (Call(__import__("collections").defaultdict, (1, 2)), "defaultdict"),
    ],
)
def test_calls_outside_the_grammar_are_refused(value, words):
    msg = refused(pickle.dumps({"v": value}, protocol=2), words, kind=UnsafePickleError, max_bytes=4 << 20)
    assert "outside ckptkit's grammar" in msg or "refusing" in msg


@pytest.mark.parametrize(
    "value",
    [
        Call(bytearray, (b"ab",)),
        Call(bytearray, ("ab", "latin-1")),
        Call(bytearray, (16,)),
        Call(bytes, ()),
        Call(set, ([1, 2],)),
        Call(frozenset, (["x"],)),
        Call(range, (1, 9, 2)),
        Call(complex, (1.0, -2)),
        Call(slice, (1, None)),
        Call(OrderedDict, ([("a", 1), ["b", 2]],)),
        Call(torch.Size, ((2, 3),)),
        Call(__import__("pathlib").PurePosixPath, ("/a", "b")),
    ],
)
def test_calls_inside_the_grammar_build_their_value(value):
    data = pickle.dumps({"v": value}, protocol=2)
    assert loads(data)["v"] == value.func(*value.args)


@pytest.mark.parametrize("size,stride", [((2**30,), (0,)), ((3, 2**23), (0, 0))])
def test_small_storage_viewed_as_big_tensor_is_refused(size, stride):
    from ckptkit.safeload import RawStorage, typed_storage

    data = pickle.dumps(
        {"v": Call(torch._utils._rebuild_tensor_v2, ("S", 0, size, stride, False, OrderedDict()))}, protocol=2
    ).replace(b"X\x01\x00\x00\x00S", b"X\x01\x00\x00\x00SQ")
    with pytest.raises(FormatError, match="strided view"):
        restricted_loads(data, "f.pkl", lambda pid: typed_storage(RawStorage(bytes(8)), DType("float32")))


@pytest.mark.parametrize(
    "args",
    [
        ("S", "0", (2,), (1,), False, OrderedDict()),
        ("S", 0, (-2,), (1,), False, OrderedDict()),
        ("S", 0, (2,), (1.5,), False, OrderedDict()),
        ("S", 0, (2,), (1,), "yes", OrderedDict()),
        ("S", 0, (2,) * 65, (1,) * 65, False, OrderedDict()),
        ("S",),
    ],
)
def test_tensor_rebuild_arguments_are_typed(args):
    from ckptkit.safeload import StorageRef, typed_storage

    data = pickle.dumps({"v": Call(torch._utils._rebuild_tensor_v2, args)}, protocol=2)
    data = data.replace(b"X\x01\x00\x00\x00S", b"X\x01\x00\x00\x00SQ", 1)
    with pytest.raises(UnsafePickleError, match="_rebuild_tensor_v2"):
        restricted_loads(
            data, "f.pkl", lambda pid: typed_storage(StorageRef("0", DType("float32"), 2), DType("float32"))
        )


def test_colliding_set_keys_are_refused():
    """Ints equal modulo 2**61-1 share one hash: a set of them makes each insert walk all the others."""
    keys = [7 + j * (2**61 - 1) for j in range(200)]
    assert len({hash(k) for k in keys}) == 1
    refused(pickle.dumps({"v": frozenset(keys)}, protocol=4), "collide")
    refused(pickle.dumps({"v": set(keys)}, protocol=4), "collide")
    refused(pickle.dumps({"v": set(keys)}, protocol=2), "collide")


# ---- 3. expansion and depth ------------------------------------------------------------------


def test_shared_lists_expand_exponentially_and_are_refused_at_load():
    data = shared_lists(40)
    assert len(data) < 1536
    refused(data, "MAX_PICKLE_EXPANDED", kind=FormatError, max_bytes=4 << 20, max_seconds=1.0)


def test_expanded_limit_grows_with_a_real_metadata_but_not_for_a_small_bomb(monkeypatch):
    """The expanded-size bound scales with the pickle's own size (a few values per byte): a real
    DCP .metadata, whose chunks share dtypes and properties, is read however many tensors it holds,
    while the same fixed floor still refuses the 1.5 KB bomb. Shrinking the floor stands in for a
    500k-tensor .metadata, too slow to build here."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    props = TensorProperties(dtype=torch.float32)
    sdm, storage = {}, {}
    for i in range(3000):
        fqn = f"layers.{i}.w"
        sdm[fqn] = TensorStorageMetadata(
            props, torch.Size([4, 4]), [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))]
        )
        storage[MetadataIndex(fqn, torch.Size([0, 0]), 0)] = _StorageInfo("__0_0.distcp", i * 64, 64)
    data = pickle.dumps(Metadata(sdm, storage_data=storage))
    monkeypatch.setattr(knobs, "MAX_PICKLE_EXPANDED", 1000)
    md = loads(data, ".metadata")
    assert len(md.state_dict_metadata) == 3000
    refused(shared_lists(40), "MAX_PICKLE_EXPANDED", kind=FormatError)


@pytest.mark.parametrize("cmd,wrap", [("inspect", False), ("inspect --json", False), ("inspect", True)])
def test_shared_lists_in_a_dcp_bytes_item_are_refused(cmd, wrap, tmp_path):
    """The instance: the item's value is the list; on main `inspect` walked 2**40 nodes (a hang)."""
    data = in_dict(shared_lists(40)[2:-1]) if wrap else shared_lists(40)
    src, rel = plant_bytes_item(tmp_path, archive_of(data))
    cli_refused(*cmd.split(), src, source=src, names=(rel, "MAX_PICKLE_EXPANDED"))


def test_shared_lists_in_a_torch_save_file_are_refused(tmp_path):
    src = tmp_path / "model.pt"
    src.write_bytes(archive_of(in_dict(shared_lists(40)[2:-1])))
    cli_refused("inspect", src, source=src, names=("model.pt", "MAX_PICKLE_EXPANDED"))


def _doubling(levels: int, make: bytes) -> bytes:
    """X0 = 1; X(k) = make(X(k-1), X(k-1)) through the memo; `make` consumes two GETs."""
    out = b"\x80\x04K\x01" + put(0)
    for k in range(1, levels + 1):
        out += make.replace(b"A", get(k - 1)) + put(k)
    return out + b"."


@pytest.mark.parametrize(
    "name,make",
    [
        ("tuples", b"AA\x86"),
        ("dicts", b"}(" + op_str("a") + b"A" + op_str("b") + b"Au"),
        ("frozensets", b"(AA" + b"\x85\x91"),  # frozenset({(x,)}) of a one-tuple of each: still shared twice
        (
            "stand-ins",
            b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\n)\x81}("
            + op_str("fqn")
            + b"A"
            + op_str("offset")
            + b"Aub",
        ),
        ("call arguments", b"ctorch.distributed.checkpoint.metadata\nStorageMeta\n(AAtR"),
        ("a list filled by APPEND", b"]A" + b"aA" + b"a"),
    ],
)
def test_every_kind_of_sharing_counts_each_time_it_is_reached(name, make):
    refused(_doubling(40, make), "MAX_PICKLE_EXPANDED", max_bytes=8 << 20, max_seconds=1.0)


def test_a_long_string_shared_many_times_is_refused():
    """2000 references to one 1 MB string: 2 GB to print."""
    data = b"\x80\x04]" + b"(" + b"X" + struct.pack("<I", 1 << 20) + b"s" * (1 << 20) + put(0) + get(0) * 2000 + b"e."
    refused(data, "MAX_PICKLE_EXPANDED", max_bytes=8 << 20)


def test_dup_shares_too():
    refused(_doubling(40, b"A2\x86"), "MAX_PICKLE_EXPANDED", max_seconds=1.0)


def test_small_legit_sharing_loads_like_pickle():
    x = [1, {"a": (2, 3)}]
    value = {"a": x, "b": x, "c": (x, x), "s": "y" * 100, "t": "y" * 100}
    for protocol in range(6):
        data = pickle.dumps(value, protocol=protocol)
        assert loads(data) == pickle.loads(data)


@pytest.mark.parametrize(
    "ops",
    [
        b"]" + put(0) + get(0) + b"a.",  # a list appended to itself
        b"}" + put(0) + b"K\x01" + get(0) + b"s.",  # a dict holding itself
        b"]" + put(0) + b"(" + get(0) + b"e.",  # APPENDS of itself
        b"ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81" + put(0) + b"}" + op_str("x") + get(0) + b"sb.",
        b"]" + put(0) + b"0" + get(0) + b"K\x01a.",  # changed after it was fetched again
        b"]2K\x01a.",  # changed after DUP
    ],
)
def test_self_reference_and_change_after_sharing_are_refused(ops):
    refused(b"\x80\x04" + ops, "shared")


def _chain(n: int, kind: str) -> bytes:
    if kind == "tuple1":  # inside-out: ((((1,),),),)
        return b"\x80\x04K\x01" + b"\x85" * n + b"."
    if kind == "list-append":  # outside-in, APPEND
        return b"\x80\x04" + b"]" * n + b"a" * (n - 1) + b"."
    if kind == "dict":
        return b"\x80\x04}" + (op_str("k") + b"}") * (n - 1) + b"s" * (n - 1) + b"."
    if kind == "frozenset":  # frozenset({frozenset({... 1})})
        return b"\x80\x04" + b"(" * n + b"K\x01" + b"\x91" * n + b"."
    if kind == "call":  # a stand-in holding a stand-in holding ... (its arguments)
        return (
            b"\x80\x04"
            + b"ctorch.distributed.checkpoint.metadata\nStorageMeta\n" * (n // 2)
            + b"K\x01"
            + b"\x85R" * (n // 2)
            + b"."
        )
    if kind == "state":  # BUILD states nested
        return (
            (b"\x80\x04" + b"ctorch.distributed.checkpoint.metadata\nStorageMeta\n)\x81}" + op_str("x")) * (n // 2)
            + b"N"
            + b"sb" * (n // 2)
            + b"."
        )
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["tuple1", "list-append", "dict", "frozenset", "call", "state"])
def test_nesting_deeper_than_the_limit_is_refused(kind):
    refused(_chain(20_000, kind), "MAX_PICKLE_DEPTH", max_seconds=2.0)


def test_depth_limit_is_exact():
    n = knobs.MAX_PICKLE_DEPTH
    assert loads(_chain(n, "list-append")) is not None
    refused(_chain(n + 1, "list-append"), "MAX_PICKLE_DEPTH")


# ---- every limit: a FormatError naming the file and the limit ---------------------------------


@pytest.mark.parametrize(
    "knob,value,data",
    [
        ("MAX_PICKLE_OBJECTS", 1000, pickle.dumps([{} for _ in range(2000)], protocol=2)),
        ("MAX_PICKLE_OBJECTS", 1000, pickle.dumps([str(i) for i in range(2000)], protocol=4)),
        ("MAX_PICKLE_DEPTH", 5, pickle.dumps([[[[[[1]]]]]], protocol=4)),
        ("MAX_PICKLE_EXPANDED", 1000, pickle.dumps([[0] * 100] * 20, protocol=4)),
        ("MAX_PICKLE_BLOB", 1000, pickle.dumps(b"x" * 2000, protocol=4)),
        ("MAX_PICKLE_BUILT", 1000, pickle.dumps(np.zeros(1000), protocol=2)),
        ("MAX_PICKLE_SECONDS", -100.0, pickle.dumps({i: i for i in range(5000)}, protocol=2)),
    ],
)
def test_each_limit_names_the_file_and_the_knob(knob, value, data, monkeypatch):
    monkeypatch.setattr(knobs, knob, value)
    refused(data, knob, kind=FormatError, file="some/dir/file.pkl")


def test_limits_leave_real_checkpoints_alone():
    """The largest fixtures' pickles load well within every limit (sizes measured, not assumed)."""
    from ckptkit.safeload.grammar import RestrictedGrammar
    from ckptkit.safeload.vm import Machine

    data = (ROOT / "fixtures" / "data" / "fsdp2_w2" / ".metadata").read_bytes()
    m = Machine(data, RestrictedGrammar("md", None))
    m.run()
    assert m.objects + len(m.memo) < knobs.MAX_PICKLE_OBJECTS // 100
    assert m.extra < knobs.MAX_PICKLE_EXPANDED // 100 and max(m.depths) < knobs.MAX_PICKLE_DEPTH // 4


def test_a_zero3_optimizer_of_20k_parameters_fits():
    """DeepSpeed ZeRO-3 optimizer files hold lists of one int per parameter."""
    groups = [{"params": list(range(20_000)), "lr": 1e-3, "betas": (0.9, 0.999)}]
    state = {
        "optimizer_state_dict": {"param_groups": groups, "state": {i: {"step": i} for i in range(20_000)}},
        "ds_config": {"zero_optimization": {"stage": 3}},
    }
    got = loads(pickle.dumps(state, protocol=2))
    assert got == state


# ---- 4. JSON ------------------------------------------------------------------------------------

DEEP = 100_000


def deep_json(n: int = DEEP) -> str:
    return "[" * n + "]" * n


def write_safetensors(path: Path, header: dict | str, data: bytes = b"") -> None:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_deep_json_in_a_safetensors_header_is_refused(tmp_path):
    src = tmp_path / "model.safetensors"
    write_safetensors(
        src, '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": ' + deep_json() + "}", b"\0" * 4
    )
    cli_refused("inspect", src, source=src, names=("model.safetensors", "MAX_JSON_DEPTH"))


def test_deep_json_in_an_index_is_refused(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    write_safetensors(
        src / "model-00001-of-00001.safetensors",
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        b"\0" * 4,
    )
    (src / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "model-00001-of-00001.safetensors"}, "metadata": ' + deep_json() + "}"
    )
    cli_refused("inspect", src, source=src, names=("model.safetensors.index.json", "MAX_JSON_DEPTH"))


def test_deep_json_in_a_metadata_value_is_refused(tmp_path):
    src = tmp_path / "model.safetensors"
    write_safetensors(
        src,
        {
            "__metadata__": {"ckptkit.objects": '{"a": ' + deep_json() + "}"},
            "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        },
        b"\0" * 4,
    )
    cli_refused("inspect", src, source=src, names=("model.safetensors", "__metadata__", "MAX_JSON_DEPTH"))


def test_deep_json_in_a_ds_config_is_refused(tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    cfg = tmp_path / "ds_config.json"
    cfg.write_text('{"zero_optimization": ' + deep_json() + "}")
    out = tmp_path / "OUT"
    cli_refused(
        "convert",
        src,
        out,
        "--to",
        "zero3",
        "--ds-config",
        cfg,
        source=tmp_path / "ckpt",
        out=out,
        names=("ds_config.json", "MAX_JSON_DEPTH"),
    )


@pytest.mark.parametrize(
    "text,want",
    [
        ("1", 0),
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('["[[[[", "]]"]', 1),
        (r'["\"[[[", "\\"]', 1),
        ('{"a": "}}}}"}', 1),
    ],
)
def test_json_depth_ignores_brackets_in_strings(text, want):
    assert safe_json.depth(text) == want


def test_json_depth_limit_is_exact():
    n = knobs.MAX_JSON_DEPTH
    assert safe_json.loads(deep_json(n), "x.json") == json.loads(deep_json(n))
    with pytest.raises(FormatError, match="x.json: JSON is nested more than"):
        safe_json.loads(deep_json(n + 1), "x.json")
    with pytest.raises(UsageError, match="cfg.json: the config is not valid JSON"):
        safe_json.loads(b"{", "cfg.json", "the config", UsageError)
    with pytest.raises(FormatError, match="not UTF-8"):
        safe_json.loads(b"\xff", "x.json")
    with pytest.raises(FormatError, match="not valid JSON"):
        safe_json.loads("1" * 5000, "x.json")  # an int of more digits than Python converts


def test_no_reader_parses_checkpoint_json_by_itself():
    """Formats, operations and conversions parse JSON only through safe_json."""
    for part in ("formats", "ops", "index", "convert"):
        for path in (ROOT / "ckptkit" / part).rglob("*.py"):
            text = path.read_text().replace("json.loads(json.dumps(", "")  # a copy of ckptkit's own value
            assert not re.search(r"\bjson\.load", text), f"{path} parses JSON without ckptkit.safe_json"


def test_deep_values_fail_before_any_recursive_walk(tmp_path):
    """A 200-deep list is refused at load, so no later walk (realize, inspect, JSON) recurses."""
    data = in_dict(b"]" * 200 + b"a" * 199)
    refused(data, "MAX_PICKLE_DEPTH")
