"""Megatron-Core's `.metadata` keeps torch's save plans (`Metadata.all_local_plans`: SavePlan,
WriteItem, WriteItemType, TensorWriteData): rebuilt as data, by the fast road and the machine
alike, and nothing else comes through with them: foreign globals stay refused, fields torch never
writes and shared lists send the file to the machine, which then reads exactly the same."""

from __future__ import annotations

import random

import pytest

from ckptkit.errors import UnsafePickleError
from ckptkit.repickle import dumps
from ckptkit.safeload import dcp as safeload_dcp, restricted_loads
from ckptkit.safeload.inert import inert_class
from conftest import DATA
from helpers.fast_road import same_or_declined

SEED = DATA / "mcore" / "tp2_swiglu_gqa" / "iter_0000002" / ".metadata"
PLANNER = "torch.distributed.checkpoint.planner"


def machine(data: bytes):
    return restricted_loads(data, "f.metadata")


def _global(module: str, name: str) -> bytes:
    m, n = module.encode(), name.encode()
    return b"\x8c" + bytes([len(m)]) + m + b"\x8c" + bytes([len(n)]) + n + b"\x93"


def test_mcores_plans_are_data_on_both_roads():
    data = SEED.read_bytes()
    fast = safeload_dcp.load(data)
    assert fast is not None and fast == machine(data)
    plans = fast.all_local_plans
    assert len(plans) == 2 and all(type(p) is inert_class(f"{PLANNER}.SavePlan") for p in plans)
    items = [item for plan in plans for item in plan.items]
    assert {item.type._args for item in items} <= {(1,), (2,), (3,)}  # TENSOR, SHARD, BYTE_IO
    assert all(item.tensor_data is None or item.tensor_data.size for item in items)


def test_byte_mutations_of_an_mcore_metadata_are_declined_or_equal():
    seed = SEED.read_bytes()
    rng = random.Random(29)
    taken = 0
    for _ in range(600):
        data = bytearray(seed)
        at = rng.randrange(2, len(data))
        data[at] = rng.randrange(256)
        taken += same_or_declined(safeload_dcp.load, machine, bytes(data))
    assert taken >= 30


def test_an_item_list_shared_by_two_plans_is_declined():
    md = machine(SEED.read_bytes())
    md.all_local_plans[1].__dict__["items"] = md.all_local_plans[0].items
    data = dumps(md, protocol=2)
    assert safeload_dcp.load(data) is None
    assert machine(data) == md


@pytest.mark.parametrize(
    "field,value",
    [("bytes_io_data", "not torch's"), ("unexpected", 1), ("type", "SHARD"), ("tensor_data", [1, 2])],
)
def test_write_item_fields_torch_never_writes_are_declined(field, value):
    md = machine(SEED.read_bytes())
    md.all_local_plans[0].items[0].__dict__[field] = value
    data = dumps(md, protocol=2)
    assert safeload_dcp.load(data) is None
    assert machine(data) == md


@pytest.mark.parametrize(
    "module,name", [("os", "system"), ("builtins", "eval"), ("subprocess", "Popen"), ("torch", "load")]
)
def test_a_plan_carrying_a_foreign_global_is_refused(module, name):
    """A SavePlan stand-in called with a foreign callable: nothing runs, the file is refused."""
    data = (
        b"\x80\x04"
        + _global(PLANNER, "SavePlan")
        + _global(module, name)
        + b"\x8c\x02id\x85R\x85R."  # SavePlan(os.system("id"))
    )
    assert safeload_dcp.load(data) is None
    with pytest.raises(UnsafePickleError, match=f"refusing to unpickle global '{module}.{name}'"):
        machine(data)


def test_other_planner_classes_stay_refused():
    for name in ("LoadPlan", "ReadItem", "SavePlanner", "LoadPlanner"):
        data = b"\x80\x04" + _global(PLANNER, name) + b")R."
        assert safeload_dcp.load(data) is None
        with pytest.raises(UnsafePickleError, match="refusing to unpickle global"):
            machine(data)
