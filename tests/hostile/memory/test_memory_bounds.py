"""Memory stays bounded on hostile input, and `verify --deep` never passes a bad checkpoint.

Every size a file declares (a zstd frame's output, a zip member, a storage, a view's extent) is
checked before anything that size is allocated. Each class of attack is crafted here as an
attacker would (torch, zstandard, zipfile and struct edits; tests/helpers/memory_craft.py) and run
through the CLI under tests/helpers/hostile.py: exit 2 (verify: 1, its problems listed) with a sentence
naming the file, no traceback, peak RSS <= max(budget, 2 x the hostile file's size) + 100 MB over
the interpreter's own, within the timeout, source unchanged, nothing left beside OUT.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import hostile
from conftest import has_zstd
from helpers.ds_fixtures import DS_DATA, ds_fixtures
from helpers.memory_craft import (
    FakeStorage,
    FakeTensor,
    RawView,
    local_header_offset,
    patch_member,
    replace_item,
    save_dcp,
    set_declared,
    torch_save_archive,
    torch_save_bytes,
    zstd_of,
    zstd_of_zeros,
)

from ckptkit import knobs
from ckptkit.errors import FormatError

MB = 1 << 20
BUDGET = "64MB"
BUDGET_BYTES = 64 * 10**6
TIMEOUT = 90.0
needs_zstd = pytest.mark.skipif(not has_zstd(), reason="reading zstd-compressed DCP items needs the zstandard package")
EVERY = ("inspect", "verify", "consolidate", "convert")
FOLDER = EVERY + ("reshard",)


def run_cmd(cmd: str, src: Path, tmp_path: Path, budget: str = BUDGET) -> tuple[hostile.Run, hostile.Scene, int]:
    """Run one command on `src` under the harness; (run, scene, the budget in force)."""
    out = tmp_path / "parent" / "OUT"
    out.parent.mkdir(exist_ok=True)
    limit = ("--memory-budget", budget)
    args = {
        "inspect": ("inspect", src),
        "verify": ("verify", "--deep", src, *limit),
        "consolidate": ("consolidate", src, out, *limit),
        "convert": ("convert", src, out, "--to", "dcp", *limit),
        "reshard": ("reshard", src, out, "--to", "2", *limit),
    }[cmd]
    scene = hostile.Scene(src, out if cmd not in ("inspect", "verify") else None)
    run = hostile.run_ckptkit(*args, timeout=TIMEOUT)
    return run, scene, knobs.MEMORY_BUDGET if cmd == "inspect" else knobs.parse_size(budget)


def check(cmd: str, src: Path, hostile_file: Path, tmp_path: Path, *names: str) -> hostile.Run:
    """The whole contract for a refused hostile input (verify: its problems listed, exit 1)."""
    run, scene, budget = run_cmd(cmd, src, tmp_path)
    bound = hostile.rss_bound(budget, hostile_file.stat().st_size, with_torch=cmd != "inspect")
    hostile.check_refused(run, *names, scene=scene, code=1 if cmd == "verify" else 2, rss_limit=bound)
    return run


# ---- 1. compressed DCP items: bounded by what the metadata declares, streamed past the budget ---------


def _bombed_dcp(folder: Path, shape: tuple[int, ...], inflate: int) -> str:
    """A zstd DCP checkpoint whose item of model.w (declared `shape`) inflates to `inflate` bytes."""
    save_dcp(folder, {"model": {"w": torch.zeros(shape), "b": torch.randn(64)}}, zstd=True)
    return replace_item(folder, "model.w", zstd_of_zeros(inflate))


@needs_zstd
@pytest.mark.parametrize("cmd", ["verify", "consolidate", "convert", "reshard"])
def test_a_zstd_bomb_in_a_tensor_item_is_refused_at_what_the_metadata_declares(cmd, tmp_path):
    """90 KB that inflate to 3 GB, where the metadata declares a 16 KB tensor (was 6.4 GB peak)."""
    src = tmp_path / "ckpt"
    data = _bombed_dcp(src, (64, 64), 3 << 30)
    run = check(cmd, src, src / data, tmp_path, data, "model.w")
    assert "decompresses to more than" in run.stderr


@needs_zstd
@pytest.mark.parametrize("cmd", ["verify", "consolidate"])
def test_a_zstd_bomb_behind_a_large_declared_tensor_is_streamed_and_refused(cmd, tmp_path):
    """The declared 256 MB tensor is larger than the budget allows to hold: the item is decoded
    in windows, and the 2 GB it inflates to are refused at 256 MB (+ the archive around it)."""
    src = tmp_path / "ckpt"
    data = _bombed_dcp(src, (8192, 8192), 2 << 30)
    run = check(cmd, src, src / data, tmp_path, data, "model.w")
    assert "decompresses to more than" in run.stderr


@needs_zstd
@pytest.mark.parametrize("cmd", ["inspect", "verify", "consolidate"])
def test_a_zstd_bomb_in_a_value_item_is_refused_while_indexing(cmd, tmp_path):
    """A value (bytes item) is loaded whole: it may inflate to a quarter of the budget at most."""
    src = tmp_path / "ckpt"
    save_dcp(src, {"model": {"w": torch.randn(8, 8)}, "extra": {"note": "hello"}}, zstd=True)
    data = replace_item(src, "extra.note", zstd_of_zeros(2 << 30))
    run = check(cmd, src, src / data, tmp_path, data, "extra.note")
    assert "decompresses to more than" in run.stderr


@needs_zstd
def test_a_zstd_item_declaring_more_than_its_bytes_can_hold_is_refused_while_indexing(tmp_path):
    """A 1 KB frame cannot decode to 64 EB: refused before any plan is made for it."""
    src = tmp_path / "ckpt"
    save_dcp(src, {"model": {"w": torch.randn(8, 8)}}, zstd=True)
    set_declared(src, "model.w", (2**62, 4))
    check("inspect", src, src / "__0_0.distcp", tmp_path, "__0_0.distcp", "model.w")


_LEGIT = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers.memory_craft import save_dcp
g = torch.Generator().manual_seed(7)
w = torch.randint(0, 16, (10000, 5000), generator=g).float() / 4          # 200 MB, compresses ~5x
t = torch.randint(0, 16, (3000, 2000), generator=g).float().t()           # 24 MB, stored transposed
save_dcp({path!r}, {{"model": {{"w": w, "t": t, "b": torch.randn(64, generator=g)}}}}, zstd=True)
torch.save({{"w": w, "t": t.contiguous()}}, {truth!r})
"""


@needs_zstd
def test_a_legitimate_large_zstd_item_is_streamed_within_the_budget(tmp_path):
    """A 200 MB tensor in one zstd item with --memory-budget 32MB: consolidated in windows, equal
    to what was saved, peak RSS within the bound (a transposed 24 MB item too)."""
    from safetensors.torch import load_file

    src, truth, out = tmp_path / "ckpt", tmp_path / "truth.pt", tmp_path / "parent" / "OUT"
    out.parent.mkdir()
    # written by a child process: a 200 MB tensor held here would count in the CLI's peak RSS
    subprocess.run(
        [sys.executable, "-c", _LEGIT.format(tests=str(Path(__file__).parents[2]), path=str(src), truth=str(truth))],
        check=True,
        capture_output=True,
    )
    size = sum(p.stat().st_size for p in src.iterdir())
    scene = hostile.Scene(src, out)
    run = hostile.run_ckptkit("consolidate", src, out, "--memory-budget", "32MB", timeout=240)
    assert run.code == 0, run.detail()
    assert run.peak_rss <= hostile.rss_bound(32 * 10**6, size), run.detail()
    assert scene.source_unchanged()
    got, expected = load_file(str(out / "model.safetensors")), torch.load(truth)
    assert torch.equal(got["w"], expected["w"]) and torch.equal(got["t"], expected["t"])


# ---- 2. views of one storage share it; what they would copy is counted ---------------------------


def _views(base: torch.Tensor, n: int = 2500) -> tuple:
    return tuple(base[1:] for _ in range(n))  # each its own tensor object over one 1 MB storage


@pytest.mark.parametrize("cmd", EVERY)
def test_views_of_one_storage_in_a_torch_save_file_are_not_copied_per_view(cmd, tmp_path):
    """2,500 views of one 1 MB storage as a value (2.5 GB peak before): refused, never copied."""
    src = tmp_path / "views.pt"
    torch.save({"w": torch.randn(4), "views": _views(torch.randn(1 << 18))}, src)
    run = check(cmd, src, src, tmp_path, "views.pt")
    assert "loaded whole" in run.stderr or "rebuilds more bytes" in run.stderr


@pytest.mark.parametrize("cmd", FOLDER)
def test_views_of_one_storage_in_a_dcp_value_item_are_not_copied_per_view(cmd, tmp_path):
    src = tmp_path / "ckpt"
    save_dcp(src, {"model": {"w": torch.randn(4, 4)}, "extra": _views(torch.randn(1 << 18))})
    run = check(cmd, src, src / "__0_0.distcp", tmp_path, "__0_0.distcp", "extra")
    assert "loaded whole" in run.stderr or "rebuilds more bytes" in run.stderr


@pytest.mark.skipif("z1_fp32_w2" not in ds_fixtures(), reason="no DeepSpeed fixtures")
@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_views_of_one_storage_in_a_deepspeed_file_are_not_copied_per_view(cmd, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(DS_DATA / "z1_fp32_w2", src)
    victim = sorted(src.glob("*/*model_states.pt"))[0]
    state = torch.load(victim, weights_only=False)  # trusted: our own fixture
    state["client_views"] = _views(torch.randn(1 << 18))
    torch.save(state, victim)
    check(cmd, src, victim, tmp_path, victim.name)


def test_views_share_their_storage_and_copy_only_their_own_elements_when_asked():
    """Loaded whole, 2,500 views hold one storage; each view's values are still exactly torch's."""
    from ckptkit.runner.torch_archive import load_bytes_archive
    from ckptkit.safeload import realize
    from ckptkit.torch_types import SmallTensor

    base = torch.arange(1000, dtype=torch.float32)
    views = (base[3:10], base.view(10, 100).t()[2:5], base[::7], torch.tensor([2.5]).expand(4, 3), base)
    loaded = load_bytes_archive(torch_save_bytes({"v": views * 50}), "mem")["v"]
    storages = {id(t._view[0]) for t in loaded}
    assert len(storages) == 2 and all(isinstance(t, SmallTensor) and t._data is None for t in loaded)
    for got, want in zip(loaded, views * 50):
        assert torch.equal(realize(got), want)
    assert loaded[4].data is loaded[4]._view[0]  # a view of the whole storage is the storage itself


def test_the_views_of_a_torch_save_value_count_against_a_quarter_of_the_budget(tmp_path, monkeypatch):
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.runner import limits

    src = tmp_path / "v.pt"
    torch.save({"w": torch.randn(4), "views": _views(torch.randn(1 << 18), 40)}, src)  # 40 MB of views
    monkeypatch.setattr(limits, "_budget", 256 * MB)  # a quarter: 64 MB
    value = open_checkpoint(str(src)).index.objects["views"].data
    assert len(value) == 40 and len({id(t._view[0]) for t in value}) == 1
    monkeypatch.setattr(limits, "_budget", 64 * MB)  # a quarter: 16 MB
    with pytest.raises(FormatError, match=r"v\.pt: its values hold tensors loaded whole of \d+ bytes"):
        open_checkpoint(str(src))


# ---- 3. zip directories that lie --------------------------------------------------------------------

N = 3_500_000_000  # declared bytes of storage 0


def _lying_archive(lie: str) -> bytes:
    """An 8 KB torch.save file whose nested tensor (a value) declares a 3.5 GB storage."""
    obj = {
        "w": FakeTensor(FakeStorage("1", 4), 0, (4,), (1,)),
        "x": (FakeTensor(FakeStorage("0", N // 4), 0, (N // 4,), (1,)),),
        "pad": "p" * 6000,
    }
    data = torch_save_archive(obj, {"0": bytes(16), "1": bytes(16)})
    m = "archive/data/0"
    if lie == "uncompressed_size":  # stored, 16 bytes, "3.5 GB once uncompressed"
        return patch_member(data, m, usize=N)
    if lie == "deflated":  # a compressed member inflating to 3.5 GB
        return patch_member(patch_member(data, m, method=8, usize=N), m, central=False, method=8)
    if lie == "stored_size":  # both sizes 3.5 GB in 8 KB
        return patch_member(patch_member(data, m, csize=N, usize=N), m, central=False, csize=N, usize=N)
    if lie == "local_header":  # the local header disagrees with the directory
        return patch_member(data, m, central=False, csize=N, usize=N)
    if lie == "overlap":  # a member running into the next one's header
        return patch_member(patch_member(data, m, csize=64, usize=64), m, central=False, csize=64, usize=64)
    if lie == "header_offset":  # a member placed inside another's data
        return patch_member(data, m, header_offset=local_header_offset(data, "archive/data.pkl") + 40)
    raise AssertionError(lie)


LIES = ["uncompressed_size", "deflated", "stored_size", "local_header", "overlap", "header_offset"]


@pytest.mark.parametrize("lie", LIES)
def test_a_zip_directory_that_lies_is_refused_before_anything_is_allocated(lie, tmp_path):
    src = tmp_path / "lies.pt"
    src.write_bytes(_lying_archive(lie))
    assert src.stat().st_size < 8 << 10
    check("inspect", src, src, tmp_path, "lies.pt", "zip member")


@pytest.mark.parametrize("cmd", ["verify", "consolidate", "convert"])
def test_a_3_5_gb_member_in_an_8_kb_file_is_refused_by_every_command(cmd, tmp_path):
    """Was 3.4 GB peak: the member was allocated, then found to run past the end of the file."""
    src = tmp_path / "lies.pt"
    src.write_bytes(_lying_archive("uncompressed_size"))
    check(cmd, src, src, tmp_path, "lies.pt", "archive/data/0")


@pytest.mark.parametrize("cmd", ["inspect", "verify", "consolidate"])
def test_a_lying_zip_inside_a_dcp_item_is_refused(cmd, tmp_path):
    src = tmp_path / "ckpt"
    save_dcp(src, {"model": {"w": torch.randn(4)}, "extra": (torch.randn(4),)})
    data = replace_item(src, "extra", _lying_archive("uncompressed_size"))
    check(cmd, src, src / data, tmp_path, data, "archive/data/0")


# ---- 4. views whose extent exceeds their storage; slab lists are lazy ---------------------------------


def _stride0_file(path: Path, nested: bool = False) -> None:
    t = FakeTensor(FakeStorage("0", 4), 0, (2**62, 4), (0, 1))
    path.write_bytes(
        torch_save_archive(
            {"w": (t,) if nested else t, "b": FakeTensor(FakeStorage("1", 4), 0, (4,), (1,))},
            {"0": bytes(16), "1": bytes(16)},
        )
    )


@pytest.mark.parametrize("cmd", EVERY)
@pytest.mark.parametrize("nested", [False, True], ids=["tensor", "value"])
def test_a_huge_stride_0_view_of_a_tiny_storage_is_refused(cmd, nested, tmp_path):
    """[2**62, 4] with stride 0 over 16 bytes: verify --deep built an unbounded slab list before."""
    src = tmp_path / "s0.pt"
    _stride0_file(src, nested)
    run = check(cmd, src, src, tmp_path, "s0.pt")
    assert "strided view of" in run.stderr


@pytest.mark.parametrize(
    "view",
    [
        dict(offset=0, size=(1000, 1000), stride=(1000, 1)),  # past the storage
        dict(offset=3, size=(4,), stride=(1,)),  # one past
        dict(offset=0, size=(2**40, 2**40), stride=(1, 1)),
    ],
)  # overflowing span
@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_a_view_reaching_past_its_storage_is_refused(cmd, view, tmp_path):
    src = tmp_path / "past.pt"
    src.write_bytes(torch_save_archive({"w": FakeTensor(FakeStorage("0", 4), **view)}, {"0": bytes(16)}))
    run = check(cmd, src, src, tmp_path, "past.pt", "tensor w")
    assert "of a storage that holds 16" in run.stderr


@pytest.mark.parametrize("cmd", ["inspect", "verify", "consolidate"])
def test_a_stride_0_view_inside_a_dcp_item_is_refused(cmd, tmp_path):
    src = tmp_path / "ckpt"
    save_dcp(src, {"model": {"w": torch.randn(4), "b": torch.randn(4)}})
    t = FakeTensor(FakeStorage("0", 4), 0, (2**62, 4), (0, 1))
    data = replace_item(src, "model.w", torch_save_archive(t, {"0": bytes(16)}))
    set_declared(src, "model.w", (2**62, 4))
    check(cmd, src, src / data, tmp_path, data, "model.w")


def test_slab_lists_are_generated_lazily():
    from ckptkit.index.geometry import split_by_span, split_rowmajor
    from ckptkit.index.types import Box

    huge = Box((0, 0), (2**62, 4))
    assert next(iter(split_rowmajor(huge, 1 << 20))) == Box((0, 0), (1 << 18, 4))
    assert next(iter(split_by_span(huge, (4, 1), 1 << 20))) == Box((0, 0), (1 << 18, 4))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data())
def test_split_by_span_covers_the_box_in_order_within_the_span(sizes, data):
    from ckptkit.index.geometry import split_by_span, strided_span
    from ckptkit.index.types import Box

    import numpy as np

    strides = tuple(data.draw(st.lists(st.integers(0, 40), min_size=len(sizes), max_size=len(sizes))))
    offsets = tuple(data.draw(st.integers(0, 3)) for _ in sizes)
    box = Box(offsets, tuple(sizes))
    max_span = data.draw(st.integers(1, 200))
    parts = list(split_by_span(box, strides, max_span))
    seen = np.zeros(sizes, dtype=int)
    order = []
    for p in parts:
        assert strided_span(p.sizes, strides) <= max_span or p.numel == 1
        idx = tuple(slice(o - bo, o - bo + n) for o, bo, n in zip(p.offsets, box.offsets, p.sizes))
        seen[idx] += 1
        order.append(p.offsets)
    assert (seen == 1).all()
    assert order == sorted(order)


# ---- 5. negative offsets and pieces outside their zip member: verify --deep is never "ok" -------------


@pytest.mark.parametrize("cmd", EVERY)
def test_a_negative_storage_offset_is_refused(cmd, tmp_path):
    """The bytes before a storage are its zip local header: never read as tensor values."""
    src = tmp_path / "neg.pt"
    src.write_bytes(torch_save_archive({"w": FakeTensor(FakeStorage("0", 4), -8, (4,), (1,))}, {"0": bytes(16)}))
    check(cmd, src, src, tmp_path, "neg.pt")


@pytest.mark.skipif("z1_fp32_w2" not in ds_fixtures(), reason="no DeepSpeed fixtures")
@pytest.mark.parametrize("cmd", ["verify", "consolidate"])
def test_a_deepspeed_tensor_with_a_negative_storage_offset_is_refused(cmd, tmp_path):
    """verify --deep said ok to it before; its values were bytes of the zip header."""
    src = tmp_path / "ckpt"
    shutil.copytree(DS_DATA / "z1_fp32_w2", src)
    victim = sorted(src.glob("*/*model_states.pt"))[0]
    state = torch.load(victim, weights_only=False)  # trusted: our own fixture
    name, t = next(iter(state["module"].items()))
    state["module"][name] = RawView(t.clone(), -16, t.shape, t.stride())
    torch.save(state, victim)
    check(cmd, src, victim, tmp_path, victim.name)


def test_a_tensor_reference_is_checked_against_its_storage_member_by_the_reader():
    """Whatever the unpickler lets through, the reader maps no view outside its member's data."""
    from ckptkit.runner.torch_archive import open_item, tensor_location
    from ckptkit.runner.codecs import MemoryItem
    from ckptkit.safeload import StorageRef, TensorRef
    from ckptkit.torch_types import DType

    archive = open_item(MemoryItem(torch_save_bytes({"w": torch.arange(8.0)}), "mem.pt"), "mem.pt")
    f32 = DType("float32")
    ok = TensorRef(StorageRef("0", f32, 8), f32, 2, (6,), (1,))
    _, loc = tensor_location(archive, ok, "w")
    member = archive.storage_member("0")
    assert member.data_offset + 8 == loc.offset and loc.length == 24
    for offset, size, stride in [
        (-1, (4,), (1,)),
        (0, (9,), (1,)),
        (7, (2,), (1,)),
        (0, (4,), (-1,)),
        (0, (2**62, 4), (0, 1)),
        (True, (4,), (1,)),
    ]:
        with pytest.raises(FormatError, match="mem.pt: tensor w"):
            tensor_location(archive, TensorRef(StorageRef("0", f32, 8), f32, offset, size, stride), "w")


@pytest.mark.parametrize("cmd", ["verify", "consolidate"])
def test_a_negative_offset_inside_a_dcp_item_is_refused(cmd, tmp_path):
    src = tmp_path / "ckpt"
    save_dcp(src, {"model": {"w": torch.randn(4), "b": torch.randn(4)}})
    item = torch_save_archive(FakeTensor(FakeStorage("0", 4), -4, (4,), (1,)), {"0": bytes(16)})
    data = replace_item(src, "model.w", item)
    check(cmd, src, src / data, tmp_path, data)


# ---- the decoding and reading machinery, in process ---------------------------------------------------


@needs_zstd
def test_a_streamed_item_reads_any_range_like_the_bytes_themselves(tmp_path):
    """Forward, backward, across head/middle/tail and from several cursors: the same bytes."""
    import random

    from ckptkit.runner.codecs import StreamedItem, open_decoded
    from ckptkit.storage.source import LocalSource

    data = bytes(random.Random(3).getrandbits(8) for _ in range(1 << 16)) * 80  # 5 MiB
    (tmp_path / "z").write_bytes(b"junk" + zstd_of(data))
    src = LocalSource(str(tmp_path))
    size = src.size("z") - 4
    item = open_decoded(src, "z", 4, size, ("stream.zstd/1",), "z item", limit=len(data), keep=1 << 20)
    assert isinstance(item, StreamedItem) and item.size("") == len(data)
    rng = random.Random(5)
    for _ in range(60):
        a = rng.randrange(len(data))
        n = rng.randrange(min(3 << 20, len(data) - a) + 1)
        assert item.read("", a, n) == data[a : a + n]
    with pytest.raises(FormatError, match="z item: decompresses to more than the 1000 bytes"):
        open_decoded(src, "z", 4, size, ("stream.zstd/1",), "z item", limit=1000, keep=1 << 20)
    assert open_decoded(src, "z", 4, size, ("stream.zstd/1",), "z item", limit=len(data), keep=len(data)).data == data


@needs_zstd
def test_a_zstd_frame_asking_for_a_huge_window_is_refused():
    import zstandard

    from ckptkit.runner.codecs import decode

    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=30)
    writer = zstandard.ZstdCompressor(compression_params=params).compressobj()  # size unknown: a 1 GiB window
    frame = writer.compress(b"x" * 100) + writer.flush()
    with pytest.raises(FormatError, match="damaged zstd stream"):
        decode(frame, ("stream.zstd/1",), "item", limit=1 << 20)


def test_strided_pieces_are_read_in_windows_in_storage_order(tmp_path):
    """A transposed 16 MB tensor fetched slab by slab through a 1 MiB window equals torch's."""
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.runner.fetch import Fetcher
    from ckptkit.index.geometry import split_rowmajor
    from ckptkit.index.types import Box

    t = torch.arange(2048 * 2048, dtype=torch.float32).view(2048, 2048).t()
    torch.save({"t": t}, tmp_path / "t.pt")
    opened = open_checkpoint(str(tmp_path / "t.pt"))
    entry = opened.index.tensors["t"]
    assert entry.pieces[0].location.stride == (1, 2048)
    fetcher = Fetcher(opened.source, memory_budget=4 * MB)
    reads = []
    readinto = opened.source.readinto
    opened.source.readinto = lambda rel, off, buf: (reads.append(len(buf)), readinto(rel, off, buf))[1]
    for slab in split_rowmajor(Box.whole((2048, 2048)), 300 * 2048):
        assert torch.equal(fetcher.fetch(entry, slab), t[slab.offsets[0] : slab.offsets[0] + slab.sizes[0]])
    assert max(reads) <= 1 * MB


def test_view_problem_names_each_kind_of_bad_view():
    from ckptkit.torch_types import MAX_STRIDED_BYTES, view_problem

    assert view_problem(0, (4, 4), (4, 1), 4, 64) is None
    assert view_problem(0, (2, 2), (0, 1), 4, 8) is None  # a small expansion
    assert "non-negative" in view_problem(-1, (4,), (1,), 4, 64)
    assert "non-negative" in view_problem(0, (4,), (-1,), 4, 64)
    assert "non-negative" in view_problem(1.0, (4,), (1,), 4, 64)
    assert "needs bytes up to 68" in view_problem(1, (4, 4), (4, 1), 4, 64)
    assert "strided view of" in view_problem(0, (MAX_STRIDED_BYTES, 2), (0, 1), 4, 64)
    assert "different lengths" in view_problem(0, (4,), (1, 1), 4, 64)
    assert view_problem(0, (0, 2**62), (1, 1), 4, 0) is None  # empty
    assert math.prod((2**62, 4)) * 4 > MAX_STRIDED_BYTES


def test_damaged_bytes_in_a_streamed_item_are_found(tmp_path):
    """A streamed item is CRC-checked in windows like one held in memory."""
    pytest.importorskip("zstandard")
    from ckptkit.runner.torch_archive import open_item
    from ckptkit.runner.codecs import StreamedItem, open_decoded
    from ckptkit.storage.source import LocalSource

    raw = bytearray(torch_save_bytes(torch.arange(1 << 20, dtype=torch.float32)))
    raw[len(raw) // 2] ^= 0xFF
    (tmp_path / "z").write_bytes(zstd_of(bytes(raw)))
    src = LocalSource(str(tmp_path))
    item = open_decoded(src, "z", 0, src.size("z"), ("stream.zstd/1",), "z item", limit=len(raw), keep=1 << 20)
    assert isinstance(item, StreamedItem)
    with pytest.raises(FormatError, match="z item: damaged item: zip member .*/data/0 fails its CRC32"):
        open_item(item, "z item")


def test_bytes_sources_refuse_reads_past_their_end():
    from ckptkit.runner.torch_archive import BytesSource

    src = BytesSource(b"abcdef", "mem")
    assert src.read("", 2, 3) == b"cde"
    with pytest.raises(FormatError):
        src.read("", 4, 10)
