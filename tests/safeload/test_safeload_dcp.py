"""DCP's `.metadata` through Python's C unpickler inside safeload.dcp's fences.

The fast road must give exactly what ckptkit's own pickle machine (safeload.vm) gives, or decline
(None: the machine then reads the file and words any refusal). Proven on every DCP `.metadata`
that torch wrote for the fixtures, on ckptkit's own writer's output (protocol 2, LONG_BINPUT),
on opcode-level mutations (helpers/pickle_mutations) and byte-level ones of a real file, and
on the attacks the C unpickler alone would fall for: a memo index that allocates gigabytes,
BUILD on an interned dtype or on a grammar callable (state left behind for the next reader),
tuple keys crafted from wide integers, shared containers that expand, foreign globals, deep
nesting, and fields torch never writes.
"""

from __future__ import annotations

import pickletools
import random
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptkit.safeload import dcp as safeload_dcp, fence as safeload_fence
from ckptkit.errors import UnsafePickleError
from ckptkit.formats.dcp.metadata_pickle import metadata_pickle
from ckptkit.formats.dcp.writer import DCP_VERSION
from ckptkit.repickle import dumps
from ckptkit.safeload import restricted_loads, restricted_loads_dcp_metadata
from ckptkit.safeload.inert import inert_class
from ckptkit.torch_types import DType, Size
from conftest import DATA, ROOT
from helpers.dcp_metadata_inputs import SAVE_ID, many_written
from helpers.fast_road import declined_quickly, same_or_declined
from helpers.pickle_frames import reframed
from helpers.pickle_mutations import FUZZ, mutated

FIXTURES = sorted((ROOT / "fixtures").rglob("*.metadata")) + sorted((ROOT / "fixtures").rglob("__*.metadata"))
FIXTURES = sorted(set(FIXTURES))
SEED = DATA / "fsdp2_w2" / ".metadata"
META = "torch.distributed.checkpoint.metadata"


def machine(data: bytes):
    return restricted_loads(data, "f.metadata")


def test_there_are_dcp_fixtures_of_every_kind():
    """The proof below runs on many real files: FSDP2, HSDP, FSDP+TP, rank-local, zstd, trainers."""
    assert len(FIXTURES) >= 20
    assert any(p.name.startswith("__") for p in FIXTURES)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: str(p.relative_to(ROOT / "fixtures")))
def test_torch_written_metadata_takes_the_fast_road_and_equals_the_machine(path: Path):
    data = path.read_bytes()
    fast = safeload_dcp.load(data)
    assert fast is not None, f"{path}: the fast road declined a .metadata torch wrote"
    assert fast == machine(data)
    assert type(fast) is inert_class(f"{META}.Metadata")


@pytest.mark.parametrize("n,chunks", [(1, 1), (300, 2), (3000, 2)])
def test_ckptkit_written_metadata_takes_the_fast_road(n, chunks):
    """ckptkit's DCP writer pickles with protocol 2: GLOBAL lines, BINPUT, and LONG_BINPUT past
    2**16 entries at 3000 tensors of 2 chunks."""
    index, written = many_written(n, chunks)
    data = metadata_pickle(index, written, None, SAVE_ID, DCP_VERSION)
    assert data[:2] == b"\x80\x02"
    fast = safeload_dcp.load(data)
    assert fast is not None
    assert fast == machine(data)


def _same_or_declined(data: bytes) -> bool:
    return same_or_declined(safeload_dcp.load, machine, data)


@FUZZ
@given(st.data())
def test_opcode_mutations_are_declined_or_equal(data):
    _same_or_declined(data.draw(mutated(SEED.read_bytes())))


def test_byte_mutations_are_declined_or_equal():
    """2000 single-byte changes of a real file: every accepted one equals the machine's value,
    and the road takes many (a change inside a key, a size, an offset is still torch's shape)."""
    seed = SEED.read_bytes()
    rng = random.Random(17)
    taken = 0
    for _ in range(2000):
        data = bytearray(seed)
        at = rng.randrange(2, len(data))
        kind = rng.random()
        if kind < 0.6:
            data[at] = rng.randrange(256)
        elif kind < 0.8:
            del data[at]
        else:
            data.insert(at, rng.randrange(256))
        taken += _same_or_declined(bytes(data))
    assert taken >= 100


# ---- the attacks the C unpickler alone falls for ---------------------------------------------


def _declined_quickly(data: bytes, max_bytes: int = 16 << 20) -> None:
    declined_quickly(safeload_dcp.load, data, max_bytes)


@pytest.mark.parametrize("index", [0x7FFFFFFF, 1 << 20, 70_000])
def test_a_memo_index_past_the_input_is_declined_before_unpickling(index):
    """`N LONG_BINPUT 2**31-1`: 9 bytes that make the C unpickler allocate 16 GB."""
    data = b"\x80\x02N" + b"r" + struct.pack("<I", index) + b"."
    _declined_quickly(data)
    assert restricted_loads_dcp_metadata(data, "f.metadata") is None  # the machine keeps far entries apart


def _global(module: str, name: str) -> bytes:
    m, n = module.encode(), name.encode()
    return b"\x8c" + bytes([len(m)]) + m + b"\x8c" + bytes([len(n)]) + n + b"\x93"


def _text(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def test_build_cannot_rewrite_an_interned_dtype():
    """BUILD on torch.float32 (one object for the whole process) would change it for every later
    reader: the dtype refuses a state, the road declines, the dtype is unchanged."""
    f32 = DType("float32")
    before = dict(f32.__dict__)
    data = b"\x80\x04" + _global("torch", "float32") + b"}" + _text("name") + _text("int8") + b"sb."
    assert safeload_dcp.load(data) is None
    assert f32.__dict__ == before and f32.name == "float32"
    with pytest.raises(UnsafePickleError):
        restricted_loads_dcp_metadata(data, "f.metadata")


def test_build_cannot_change_a_grammar_callable():
    """torch.Size is a callable of the grammar: no state, no attributes (slots state via BUILD)."""
    size_call = safeload_dcp._globals()[("torch", "Size")]
    data = b"\x80\x04" + _global("torch", "Size") + b"N}" + _text("_rule") + b"N" + b"s\x86b."
    assert safeload_dcp.load(data) is None
    assert safeload_dcp._globals()[("torch", "Size")] is size_call
    assert size_call((3, 4)) == Size((3, 4))


def test_a_stand_in_cannot_shadow_its_own_methods():
    """Inert.__setstate__ is the grammar's BUILD: whoever unpickles a stand-in (the C unpickler
    here) cannot give it a `to_data` of its own."""
    data = b"\x80\x04" + _global(META, "StorageMeta") + b")\x81}" + _text("to_data") + b"Nsb."
    assert safeload_dcp.load(data) is None
    with pytest.raises(UnsafePickleError):
        restricted_loads_dcp_metadata(data, "f.metadata")


def test_wide_integers_that_could_seed_colliding_tuple_keys_are_declined():
    """2-tuples of 8-byte ints can be crafted to share one hash (dictionary inserts then cost
    n**2); more than MAX_WIDE_VALUES integers wider than 4 bytes send the pickle to the machine."""
    wide = b"\x8a\x08" + struct.pack("<q", (1 << 62) + 5)
    pairs = (b"K\x01" + wide + b"\x86" + b"N") * (safeload_fence.MAX_WIDE_VALUES + 1)
    data = b"\x80\x04}(" + pairs + b"u."
    _declined_quickly(data)


def test_the_scan_bounds_the_objects_by_the_opcodes_that_make_them(monkeypatch):
    """scan counts the container-making opcodes (an upper bound on the objects built) against
    max(MAX_PICKLE_OBJECTS, a quarter of the pickle's bytes): a .metadata torch wrote is well
    under a quarter; a pickle of nothing but empty lists is over it and is declined."""
    import pickle

    from ckptkit import knobs

    monkeypatch.setattr(knobs, "MAX_PICKLE_OBJECTS", 0)  # the quarter of the bytes alone bounds them
    safeload_fence.scan(SEED.read_bytes())  # (raises Decline when over)
    lists = pickle.dumps([[] for _ in range(1000)], protocol=4)  # ']' and a MEMOIZE per list: 2 bytes each
    with pytest.raises(safeload_fence.Decline):
        safeload_fence.scan(lists)
    monkeypatch.setattr(knobs, "MAX_PICKLE_OBJECTS", 1000)
    with pytest.raises(safeload_fence.Decline):
        safeload_fence.scan(lists)  # 1001 lists made
    monkeypatch.setattr(knobs, "MAX_PICKLE_OBJECTS", 1001)
    safeload_fence.scan(lists)


def _stand_ins(data: bytes):
    return machine(data)


def test_a_chunk_list_shared_by_every_tensor_is_declined():
    """Shared containers expand when walked (each tensor would walk the same long list): the road
    takes none; the machine counts the expansion."""
    md = _stand_ins(SEED.read_bytes())
    metas = [m for m in md.state_dict_metadata.values() if "chunks" in m.__dict__]
    shared = metas[0].chunks
    for m in metas:
        m.__dict__["chunks"] = shared
    data = dumps(md, protocol=2)
    assert safeload_dcp.load(data) is None
    assert machine(data) == md


def test_a_tensor_shared_by_two_keys_is_declined():
    md = _stand_ins(SEED.read_bytes())
    keys = list(md.state_dict_metadata)
    md.state_dict_metadata[keys[1]] = md.state_dict_metadata[keys[0]]
    data = dumps(md, protocol=2)
    assert safeload_dcp.load(data) is None
    assert machine(data) == md


@pytest.mark.parametrize(
    "field,value",
    [
        ("version", [[["deep"]]]),
        ("version", 3.5),
        ("unexpected", "x"),
        ("planner_data", {"k": [{"nested": 1}]}),
    ],
)
def test_fields_torch_never_writes_are_declined(field, value):
    md = _stand_ins(SEED.read_bytes())
    md.__dict__[field] = value
    data = dumps(md, protocol=2)
    assert safeload_dcp.load(data) is None
    assert machine(data) == md


def test_a_path_whose_slots_a_build_set_is_declined():
    """StorageMeta.checkpoint_id is a Path (slots): a BUILD that sets its `_str` is not kept."""
    md = _stand_ins(SEED.read_bytes())
    assert isinstance(md.storage_meta.checkpoint_id, __import__("pathlib").PurePath)
    data = dumps(md, protocol=2)
    fast = safeload_dcp.load(data)
    assert fast == machine(data)
    path_call = data.index(b"pathlib\nPurePosixPath\n")
    reduce_at = data.index(b"R", path_call)
    forged = (
        data[: reduce_at + 1]
        + b"N}"
        + b"X\x04\x00\x00\x00_str"
        + b"X\x04\x00\x00\x00evils\x86b"
        + data[reduce_at + 1 :]
    )
    assert safeload_dcp.load(forged) is None


def test_deep_nesting_is_declined():
    data = b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b"."
    _declined_quickly(data, max_bytes=64 << 20)


@pytest.mark.parametrize(
    "module,name",
    [("os", "system"), ("builtins", "eval"), ("torch", "load"), ("numpy", "dtype"), ("collections", "OrderedDict")],
)
def test_globals_outside_dcp_metadata_are_declined(module, name):
    data = b"\x80\x04" + _global(module, name) + _text("x") + b"\x85R."
    assert safeload_dcp.load(data) is None


def test_a_registered_stand_in_of_the_same_name_sends_everything_to_the_machine(monkeypatch):
    """A format may re-map a global (register_allowed): only the grammar knows what to build then."""
    from ckptkit.safeload import rules as safeload_rules

    monkeypatch.setitem(safeload_rules._EXTRA, (META, "Metadata"), inert_class(f"{META}.Metadata"))
    assert safeload_dcp.load(SEED.read_bytes()) is None


def test_the_fast_road_is_what_the_dcp_reader_uses(monkeypatch):
    """Control: the reader's `.metadata` goes through the fast road (None would mean the machine)."""
    from ckptkit.formats.dcp import reader
    from ckptkit.storage.source import LocalSource

    calls = []
    real = safeload_dcp.load
    monkeypatch.setattr(safeload_dcp, "load", lambda data: calls.append(len(data)) or real(data))
    md = reader._load_metadata(LocalSource(str(SEED.parent)), ".metadata")
    assert calls == [SEED.stat().st_size]
    assert md == machine(SEED.read_bytes())


@pytest.mark.parametrize("path", FIXTURES[:6], ids=lambda p: str(p.relative_to(ROOT / "fixtures")))
def test_metadata_whose_frames_split_tuples_takes_the_fast_road(path: Path):
    """A .metadata past 64 KB has a FRAME wherever the pickler's frame filled up, between two items
    of a torch.Size's tuple too (most 1M-tensor files have thousands): the fast road reads it, from
    the tuple's first item, and gives what the machine gives."""
    original = path.read_bytes()
    data = reframed(original)
    frames = [op for op, _, _ in pickletools.genops(data) if op.name == "FRAME"]
    assert len(frames) > 10  # (a FRAME between the two items of every 2-d tensor's torch.Size)
    fast = safeload_dcp.load(data)
    assert fast is not None, f"{path}: the fast road declined a .metadata whose frames split tuples"
    assert fast == machine(data) == machine(original)
