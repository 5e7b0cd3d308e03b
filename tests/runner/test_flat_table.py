"""Flat tables (index/virtual.FlatTable, runner/flat_table.py, storage/range_table.py): a ZeRO
partition described as arrays must plan and copy exactly the bytes its pieces name.

- On random layouts (flat_plan's generator: shuffled flat runs of several files, zeros, small
  values, boxes, broken pieces, other dtypes, unknown keys, reads past a tensor's end), a
  table's byte_ranges equal the box planner's for the pieces the table stands for, with the
  same None and the same refusal; where the table path answers, its arrays say the same.
- The writer's tables (GroupPlan) stand for the same pieces as its part lists did, for stage
  1/2 and 3 at uneven world sizes, with zero-size parameters, parameters smaller than the world
  and alignment padding.
- The gathered copy (range_table) writes the bytes and CRC32 kernel_copy writes, across windows,
  with zeros, with ranges too large or too far apart for a block (kernel_copy's path).
"""

from __future__ import annotations

import os
from pathlib import Path
import random
import zlib

import numpy as np
import pytest

from ckptkit.formats.deepspeed import partition
from ckptkit.formats.deepspeed.group_plan import GroupPlan, _parts, virtual
from ckptkit.formats.deepspeed.info import ZeroGroup
from ckptkit.index.state_keys import model_key, state_key
from ckptkit.index.types import Box, CheckpointIndex, Encoding, FlatRange, Location, Piece, TensorEntry
from ckptkit.index.virtual import FlatTable, TableEntry, flat_concat, flat_table
from ckptkit.runner.plan import Planner
from ckptkit.storage import kernel_copy, range_table
from ckptkit.storage.range_table import RangeTable
from ckptkit.storage.source import LocalSource
from helpers.flat_layouts import boxed_ranges, merged_ranges, outcome, stored_tensor


def _random_table(rng: random.Random, index: CheckpointIndex, dtype: str) -> TableEntry:
    """A table of random parts of the index's tensors (now and then an unknown key, or a part
    past its tensor's end), with random zero padding between them and at the end."""
    refs, starts, lengths, positions = [], [], [], []
    pos = 0
    keys = [k for k, e in index.tensors.items() if e.numel]
    for _ in range(rng.randint(0, 10) if keys else 0):
        pos += rng.choice([0, 0, rng.randint(1, 5)])
        target = index.tensors[rng.choice(keys)]
        start = rng.randrange(target.numel)
        end = rng.randint(start + 1, target.numel)
        if rng.random() < 0.03:
            end = target.numel + 1  # past the end: refused
        refs.append(target.key if rng.random() > 0.02 else "unknown")
        starts.append(start)
        lengths.append(end - start)
        positions.append(pos)
        pos += end - start
    numel = pos + rng.choice([0, 0, rng.randint(1, 6)])
    return flat_table(f"p.{rng.random()}", dtype, FlatTable(refs, starts, lengths, positions, numel))


@pytest.mark.parametrize("seed", range(200))
def test_a_table_names_the_bytes_its_pieces_name(seed: int) -> None:
    rng = random.Random(seed)
    dtype = rng.choice(["float32", "bfloat16"])
    index = CheckpointIndex("test", "/nowhere")
    for i in range(rng.randint(1, 6)):
        other = dtype if rng.random() < 0.9 else ("bfloat16" if dtype == "float32" else "float32")
        entry = stored_tensor(rng, f"t{i}", other, broken=rng.random() < 0.05)
        index.tensors[entry.key] = entry
    planner = Planner(index)
    for _ in range(4):
        table = _random_table(rng, index, dtype)
        pieces = flat_concat(table.key, dtype, table.table.parts())  # what the table stands for
        assert table.pieces == pieces.pieces and table.shape == pieces.shape
        want = outcome(lambda: merged_ranges(boxed_ranges(index, pieces, 0, None)))
        assert outcome(lambda: Planner(index).byte_ranges(_random_copy(table))) == want, seed
        arrays = planner.range_table(table)
        if arrays is not None:
            assert ("ok", arrays.as_list()) == want, seed
            assert arrays.total == table.nbytes


def _random_copy(entry: TableEntry) -> TableEntry:
    """The same table in a new entry (its pieces not yet made)."""
    return flat_table(entry.key, entry.dtype, entry.table)


def test_the_table_path_is_taken_for_flat_runs() -> None:
    """Flat runs of raw bytes (a ZeRO-3 parameter: a run per source rank) are planned from the
    arrays, adjacent ranges merged, zeros between; the table's pieces are never made."""
    w = TensorEntry(
        "w",
        "float32",
        (4, 4),
        [Piece(FlatRange(8, 8), Location("b", 0, 32)), Piece(FlatRange(0, 8), Location("a", 64, 32))],
    )
    v = TensorEntry("v", "float32", (3,), [Piece(FlatRange(0, 3), Location("a", 96, 12))])
    index = CheckpointIndex("test", "/nowhere", tensors={"w": w, "v": v})
    entry = flat_table("p", "float32", FlatTable(["w", "v"], [2, 0], [6, 3], [0, 6], 11))
    table = Planner(index).range_table(entry)
    assert table is not None and entry._pieces is None
    assert table.as_list() == [("a", 72, 36), (None, 0, 8)]  # w's 2..8 then v: one run of file a
    assert Planner(index).byte_ranges(entry) == table.as_list() and entry._pieces is None
    # another dtype, a virtual or unknown tensor, a run past its piece's bytes: not from the table
    for refs in (["w", "nope"],):
        assert (
            Planner(index).range_table(flat_table("q", "float32", FlatTable(refs, [0, 0], [1, 1], [0, 1], 2))) is None
        )
    assert Planner(index).range_table(flat_table("q", "bfloat16", FlatTable(["w"], [0], [1], [0], 1))) is None
    short = TensorEntry("s", "float32", (2,), [Piece(FlatRange(0, 2), Location("a", 0, 4))])
    encoded = TensorEntry("e", "float32", (2,), [Piece(FlatRange(0, 2), Location("a", 0, 999, Encoding.TORCH_SAVE))])
    index.tensors.update(s=short, e=encoded)
    for key in "se":
        assert Planner(index).range_table(flat_table("q", "float32", FlatTable([key], [0], [1], [0], 1))) is None


def test_a_table_refuses_parts_out_of_order() -> None:
    for starts, lengths, positions, numel in (
        ([0], [0], [0], 1),
        ([0, 0], [2, 2], [0, 1], 4),
        ([0], [2], [0], 1),
        ([-1], [1], [0], 1),
    ):
        with pytest.raises(ValueError):
            FlatTable(["a"] * len(starts), starts, lengths, positions, numel)


@pytest.mark.parametrize(
    "stage,world,numels,paddings",
    [
        (3, 3, [64, 64, 1, 5, 0, 2, 64], None),  # 2 -> 3 ranks: parameters straddle, some smaller than W
        (3, 5, [7, 64, 3], None),
        (3, 1, [4, 6], None),
        (2, 3, [10, 3, 7, 0, 5], [2, 1, 0, 0, 0]),  # alignment padding, the end padded to 2W
        (1, 4, [3], None),  # ranks past the end: empty partitions
    ],
)
def test_the_writers_tables_stand_for_its_parts(
    stage: int, world: int, numels: list[int], paddings: list[int] | None
) -> None:
    params = tuple((f"layer.{i}.weight", (n,)) for i, n in enumerate(numels))
    group = ZeroGroup(index=0, param_group=0, params=params, paddings=tuple(paddings) if paddings else None)
    shares = partition.rank_shares(stage, [(n, s[0]) for n, s in params], group.paddings, world)
    plan = GroupPlan(
        group=group,
        keys={"exp_avg": "float32", "step": None},
        whole={"step": 1},
        master_dtype="float32",
        has_state=True,
        shares=shares,
    )
    for rank, share in enumerate(shares):
        masters = plan.masters(rank).entry
        old = virtual(masters.key, "float32", _parts(share, model_key), 0, share.own).entry
        assert type(masters) is TableEntry and masters.pieces == old.pieces and masters.shape == old.shape
        state = plan.state(rank)
        old = virtual(
            state["exp_avg"].entry.key, "float32", _parts(share, lambda n: state_key(n, "exp_avg")), 0, share.size
        ).entry
        assert state["exp_avg"].entry.pieces == old.pieces and state["step"] == 1


def _source(tmp_path, sizes: dict[str, int]) -> LocalSource:
    rng = np.random.default_rng(0)
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return LocalSource(str(tmp_path))


@pytest.mark.parametrize("seed", range(12))
def test_the_gathered_copy_writes_kernel_copys_bytes(tmp_path, monkeypatch, seed: int) -> None:
    monkeypatch.setattr(range_table, "_WINDOW", 4096)  # many windows from a small table
    source = _source(tmp_path, {"a": 1 << 20, "b": 1 << 20})
    rng = random.Random(seed)
    unit = rng.choice([1, 2, 4, 8])
    ranges = []
    for _ in range(rng.randint(0, 400)):
        kind = rng.random()
        n = unit * rng.randint(1, 40)
        if kind < 0.1:
            ranges.append((None, 0, n))
        elif kind < 0.12 and seed % 3 == 0:  # larger than a small range: kernel_copy's path
            ranges.append(("a", unit * rng.randint(0, 1000), (kernel_copy.SMALL_READ // unit + 1) * unit))
        elif kind < 0.15:  # far apart: the window is read range by range
            ranges.append((rng.choice("ab"), unit * rng.randint(0, (1 << 20) // unit - 50), n))
        else:
            ranges.append((rng.choice("ab"), unit * rng.randint(0, 2000), n))
    files = ["a", "b"]
    table = RangeTable(
        files,
        np.array([files.index(r) if r else -1 for r, _, _ in ranges], dtype=np.int64),
        np.array([o for _, o, _ in ranges], dtype=np.int64),
        np.array([n for _, _, n in ranges], dtype=np.int64),
    )
    assert table.as_list() == ranges
    want = kernel_copy.read(source, ranges)
    assert range_table.read(source, table) == want
    with open(tmp_path / "out", "wb") as f:
        f.write(b"head")
        advanced = []
        total, crc = range_table.copy_with_crc(source, table, f, advanced.append)
    assert (tmp_path / "out").read_bytes() == b"head" + want
    assert total == len(want) == sum(advanced) and crc == zlib.crc32(want)
    os.remove(tmp_path / "out")


def test_ranges_far_apart_are_not_read_as_one_block(tmp_path, monkeypatch) -> None:
    """Memory stays flat: two ranges a megabyte apart are read each alone, not with the megabyte
    between them (kernel_copy's reads), and still give the same bytes."""
    source = _source(tmp_path, {"a": 2 << 20})
    blocks = []
    for name in ("pread_block", "source_block"):
        real = getattr(kernel_copy, name)
        monkeypatch.setattr(kernel_copy, name, lambda s, rel, o, n, real=real: blocks.append(n) or real(s, rel, o, n))
    table = RangeTable(["a"], np.array([0, 0]), np.array([0, (2 << 20) - 64]), np.array([64, 64]))
    with open(tmp_path / "out", "wb") as f:
        range_table.copy_with_crc(source, table, f)
    assert (tmp_path / "out").read_bytes() == kernel_copy.read(source, table.as_list()) and max(blocks) <= 64


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in ("z3_bf16_w2", "z3_fp16_w2", "z3_fp32_w2")
        if (Path(__file__).parents[2] / "fixtures/data/deepspeed" / n).is_dir()
    ],
)
def test_lazify_locates_empty_placeholders_as_tensor_location_does(name: str) -> None:
    """The ZeRO-3 module's empty placeholders are located without the view checks (tensor_location's
    empty_view road): the same dtype and Location as the checks (locate_view) give, for every one."""
    from ckptkit.formats.deepspeed.templates import lazify, template_of
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.index.types import Location
    from ckptkit.runner.archive_values import empty_view, locate_view
    from ckptkit.safeload import TensorRef

    info = open_checkpoint(str(Path(__file__).parents[2] / "fixtures/data/deepspeed" / name)).index.native.cell()
    model, archive = template_of(info, "model", 0)
    refs = []

    def walk(v):
        if isinstance(v, TensorRef):
            refs.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(model)
    assert any(empty_view(r) for r in refs)
    for ref in refs:
        entry = lazify(ref, archive, {}).entry
        member = archive.storage_member(ref.storage.key)
        dtype, start, length, stride = locate_view(archive, ref, "tensor", member)
        assert (entry.dtype, entry.pieces[0].location) == (
            dtype,
            Location(archive.file, member.data_offset + start, length, stride=stride),
        )


def _zero_param(rng: random.Random, key: str, dtype: str) -> TensorEntry:
    """A parameter as the ZeRO reader indexes it: flat runs in order, one per source rank, each
    in that rank's file (none for a zero-size parameter)."""
    shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(1, 2)))
    numel = int(np.prod(shape))
    item = 4 if dtype == "float32" else 2
    pieces, pos, world = [], 0, rng.randint(1, 3)
    per = -(-numel // world)
    for rank in range(world):
        length = max(0, min(per, numel - pos))
        if length:
            pieces.append(
                Piece(
                    FlatRange(pos, length),
                    Location(f"r{rank}", rng.randint(0, 99) * 8, length * item + rng.choice([0, 0, 4])),
                )
            )
        pos += length
    return TensorEntry(key, dtype, shape, pieces)


def _spoiled(rng: random.Random, entry: TensorEntry) -> TensorEntry:
    """The entry with one thing SourceRuns' usual path must not take: a box, a gap, a run out of
    order or past its piece's bytes, an empty run, zeros, a stride, a float, a virtual tensor."""
    pieces = list(entry.pieces)
    how = rng.choice(["box", "gap", "order", "long", "empty", "zeros", "stride", "float", "virtual"])
    if how == "virtual" or not pieces:
        return TensorEntry(entry.key, entry.dtype, entry.shape, pieces, attrs={"virtual": "x"})
    i = rng.randrange(len(pieces))
    region, loc = pieces[i].region, pieces[i].location
    if how == "box":
        pieces[i] = Piece(Box((region.start,), (region.length,)), loc)
    elif how == "gap":
        pieces[i] = Piece(FlatRange(region.start + 1, region.length), loc)
    elif how == "order":
        pieces.reverse()
        if len(pieces) == 1:
            pieces.append(pieces[0])
    elif how == "long":
        item = 4 if entry.dtype == "float32" else 2
        pieces[i] = Piece(region, Location(loc.file, loc.offset, region.length * item - 1))
    elif how == "empty":
        pieces.insert(i, Piece(FlatRange(region.start, 0), loc))
    elif how == "zeros":
        pieces[i] = Piece(region, Location("", 0, loc.length, Encoding.ZEROS))
    elif how == "stride":
        pieces[i] = Piece(region, Location(loc.file, loc.offset, loc.length, stride=(1,)))
    elif how == "float":
        object.__setattr__(region, "start", float(region.start))
        pieces[i] = Piece(region, loc)
    return TensorEntry(entry.key, entry.dtype, entry.shape, pieces)


def _runs_state(runs) -> tuple:
    return (
        runs._row_of,
        runs._first,
        runs._count,
        runs._numel,
        runs._dtype,
        runs._dtypes,
        runs._start,
        runs._length,
        runs._file,
        runs._offset,
        runs.files,
    )


@pytest.mark.parametrize("seed", range(100))
def test_a_batch_of_zero_parameters_registers_as_one_at_a_time(seed: int) -> None:
    """SourceRuns registers a batch of the usual tensors (a ZeRO partition's parameters) on arrays
    (_register_usual): the same rows, runs, files and dtype codes as the one-at-a-time pass; a
    batch holding anything else is left to that pass whole."""
    from ckptkit.runner.flat_table import SourceRuns

    rng = random.Random(seed)
    index = CheckpointIndex("test", "/nowhere")
    for i in range(rng.randint(1, 40)):
        entry = _zero_param(rng, f"t{i}", rng.choice(["float32", "float32", "bfloat16"]))
        index.tensors[entry.key] = entry
    keys = list(index.tensors)
    spoil = rng.random() < 0.5
    if spoil:
        key = rng.choice(keys)
        index.tensors[key] = _spoiled(rng, index.tensors[key])
    fast, slow = SourceRuns(index.tensors), SourceRuns(index.tensors)
    taken = fast._register_usual(keys)
    slow._register_each(keys)
    if taken:
        assert _runs_state(fast) == _runs_state(slow), seed
    else:  # nothing registered (the general checks may still take the spoiled one, sorted or boxed)
        assert spoil and _runs_state(fast) == _runs_state(SourceRuns(index.tensors)), seed
    if not spoil:
        assert taken, seed
    either = SourceRuns(index.tensors)
    either._register_all(keys)
    assert _runs_state(either) == _runs_state(slow), seed
