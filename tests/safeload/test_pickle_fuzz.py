"""Structure-aware fuzzing of the restricted unpickler, opcode by opcode, from real pickles.

Seeds are pickles real frameworks wrote: a DCP .metadata (fixtures/data/fsdp2_w2, torch's
dcp.save), a torch.save data.pkl (fixtures/data/plain_state_dict.pt), a DeepSpeed ZeRO-3
optimizer data.pkl (fixtures/data/deepspeed/z3_bf16_w2), and a torch.save of the RNG states a
trainer keeps (numpy, torch, Python). Hypothesis mutates them at the level of opcodes: drop,
duplicate or swap opcodes, change an argument, insert a GLOBAL from a small dangerous set (with or
without a call), change a declared length, insert a bare opcode (BUILD, REDUCE, DUP, GET ...).

Every mutated pickle must either load or raise a CkptkitError (never anything else), allocate at
most ALLOC_BOUND (tracemalloc) and finish within TIME_BOUND of CPU. Hypothesis runs derandomized with a
bounded number of examples and no database, so CI runs the same cases every time (about 30 s).
"""

from __future__ import annotations

import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings

import ckptkit.formats.deepspeed.standins  # noqa: F401  (DeepSpeed's classes join the allowlist)
from ckptkit.errors import CkptkitError, FormatError
from ckptkit.safeload import RawStorage, StorageRef, restricted_loads, storage_pid, typed_storage
from helpers.pickle_mutations import FUZZ, SEEDS, mutated

ALLOC_BOUND = 64 << 20
TIME_BOUND = 1.0


# ---- seeds ------------------------------------------------------------------------------------


def persistent_loader(storages: dict[str, bytes] | None, eager: bool):
    """What ckptkit's torch.save reader does with a persistent id: the named storage, checked."""
    if storages is None:
        return None

    def load(pid):
        key, dtype, numel = storage_pid(pid, "fuzz.pkl")
        if key not in storages:
            raise FormatError(f"fuzz.pkl: no storage {key}")
        nbytes = numel * dtype.itemsize
        if len(storages[key]) < nbytes:
            raise FormatError(f"fuzz.pkl: storage {key} holds {len(storages[key])} bytes, not {nbytes}")
        if eager:
            return typed_storage(RawStorage(storages[key][:nbytes]), dtype)
        return typed_storage(StorageRef(key, dtype, numel), dtype)

    return load


# ---- opcodes ----------------------------------------------------------------------------------


# ---- the property -----------------------------------------------------------------------------


def check(data: bytes, storages, eager: bool) -> None:
    """Only CkptkitErrors escape; allocation and time stay bounded."""
    tracemalloc.start()
    start = time.process_time()  # CPU time: the bound is the unpickler's work, not the machine's load
    try:
        restricted_loads(data, "fuzz.pkl", persistent_loader(storages, eager))
    except CkptkitError as exc:
        assert str(exc).startswith("fuzz.pkl"), str(exc)
    finally:
        seconds = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= ALLOC_BOUND, f"allocated {peak >> 20} MB for a {len(data)}-byte pickle"
    assert seconds <= TIME_BOUND, f"took {seconds:.2f} s for a {len(data)}-byte pickle"


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """numpy's part of the grammar is built once, outside the measured allocations."""
    from ckptkit.safeload import numpy as safeload_numpy

    safeload_numpy.grammar()


@pytest.mark.parametrize("name", list(SEEDS))
def test_seeds_load(name):
    data, storages, eager = SEEDS[name]
    assert restricted_loads(data, name, persistent_loader(storages, eager)) is not None
    check(data, storages, eager)


@pytest.mark.parametrize("name", list(SEEDS))
def test_mutated_pickles_only_raise_ckptkit_errors(name):
    data, storages, eager = SEEDS[name]

    @FUZZ
    @given(mutated(data))
    def run(mutant: bytes) -> None:
        check(mutant, storages, eager)

    run()


def test_the_mutator_reaches_the_dangerous_paths():
    """Control: the mutations do produce refusals of globals, declared lengths and states."""
    data, storages, eager = SEEDS["torch_save"]
    seen: set[str] = set()

    @settings(
        derandomize=True,
        max_examples=300,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(mutated(data))
    def run(mutant: bytes) -> None:
        try:
            restricted_loads(mutant, "fuzz.pkl", persistent_loader(storages, eager))
        except CkptkitError as exc:
            seen.add(type(exc).__name__)
            msg = str(exc)
            for word in ("refusing to unpickle global", "past the end", "refusing to call", "truncated"):
                if word in msg:
                    seen.add(word)

    run()
    assert {"UnsafePickleError", "FormatError", "refusing to unpickle global"} <= seen, seen
