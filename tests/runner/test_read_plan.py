"""The read plan (runner/plan.py): typed frozen values, computed without IO, validated with the
sentences users know, and enough on its own to rebuild every tensor of every reader's fixtures.

For each fixture, every tensor's plan covers it exactly once; an independent reading of its RAW
spans (bytes at (file, offset, length), viewed with the span's strides) equals Fetcher.fetch bit
for bit, and so do the bytes byte_ranges (a view of the plan) names. test_output_digests pins
that fetch itself reads what it read before the plan existed.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from click.testing import CliRunner

from ckptkit.errors import FormatError
from ckptkit.formats.registry import open_checkpoint
from ckptkit.index import geometry
from ckptkit.index.dtypes import torch_dtype
from ckptkit.index.types import Box, Encoding, FlatRange, Location, Piece, TensorEntry
from ckptkit.index.virtual import Part, flat_concat, flat_slice, inline_tensor
from ckptkit.runner.fetch import Fetcher
from ckptkit.runner.plan import ReadPlan, ReadSpan, plan_byte_ranges, plan_reads
from ckptkit.storage.source import LocalSource
from ckptkit_cli.main import cli
from conftest import DATA, has_zstd


def _fixtures() -> list:
    out = [
        pytest.param(DATA / "fsdp2_w2", id="dcp"),
        pytest.param(DATA / "fsdp1_sharded_w2", id="dcp-fsdp1"),
        pytest.param(DATA / "plain_state_dict.pt", id="torch_save-strided"),
        pytest.param(DATA / "deepspeed" / "z1_bf16_w2", id="zero1"),
        pytest.param(DATA / "deepspeed" / "z2_fp32_w2", id="zero2"),
        pytest.param(DATA / "deepspeed" / "z3_fp16_w2", id="zero3"),
    ]
    marks = [] if has_zstd() else [pytest.mark.skip(reason="zstd-compressed DCP items need the zstandard package")]
    out.append(pytest.param(DATA / "dcp_zstd_w2", id="dcp-zstd", marks=marks))
    return out


@pytest.fixture
def safetensors_file(tmp_path):
    from safetensors.torch import save_file

    values = {
        "a": torch.randn(3, 4),
        "b": torch.arange(7, dtype=torch.int32),
        "c": torch.tensor(True),
        "d": torch.randn(2, 2).to(torch.bfloat16),
        "e": torch.zeros(0, 3),
    }
    save_file(values, str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors"


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _rebuild_raw(source, plan: ReadPlan) -> torch.Tensor | None:
    """The plan's box read from its RAW spans alone (None when it has another encoding)."""
    dtype = torch_dtype(plan.dtype)
    out = torch.zeros(plan.box.sizes, dtype=dtype)
    for span in plan.spans:
        if span.encoding is not Encoding.RAW:
            return None
        data = bytearray(span.length)
        source.readinto(span.file, span.offset, memoryview(data))
        src = torch.frombuffer(data, dtype=torch.uint8).view(dtype).as_strided(span.box.sizes, span.strides)
        dst = out
        for d, (o, bo, n) in enumerate(zip(span.box.offsets, plan.box.offsets, span.box.sizes)):
            dst = dst.narrow(d, o - bo, n)
        dst.copy_(src)
    return out


def _assert_plan_rebuilds(opened, fetcher: Fetcher) -> set[str]:
    """Every tensor: exact cover, RAW rebuild == fetch, byte_ranges bytes == fetch. Returns the encodings seen."""
    index = opened.index
    seen: set[str] = set()
    for key, entry in index.tensors.items():
        plan = plan_reads(index, entry, label=opened.source.label, file_sizes=index.files)
        assert plan.box == Box.whole(entry.shape)
        assert sum(s.box.numel for s in plan.spans) == entry.numel, key
        assert geometry.coverage(entry.shape, [s.box for s in plan.spans]).exact or entry.numel == 0, key
        got = fetcher.fetch(entry)
        rebuilt = _rebuild_raw(opened.source, plan)
        if rebuilt is not None:
            assert _bits(rebuilt) == _bits(got), key
        ranges = fetcher.byte_ranges(entry)
        if ranges is not None:
            data = b"".join(
                bytes(f[o : o + n]) if isinstance(f, bytes) else b"\0" * n if f is None else opened.source.read(f, o, n)
                for f, o, n in ranges
            )
            assert data == _bits(got), key
        seen.update(str(s.encoding) for s in plan.walk())
    return seen


@pytest.mark.parametrize("path", _fixtures())
def test_every_reader_plan_covers_once_and_rebuilds_fetch(path):
    opened = open_checkpoint(str(path))
    seen = _assert_plan_rebuilds(opened, Fetcher(opened.source, index=opened.index))
    assert seen == ({"torch_save"} if path.name == "dcp_zstd_w2" else {"raw"})


def test_safetensors_plan(safetensors_file):
    opened = open_checkpoint(str(safetensors_file))
    assert _assert_plan_rebuilds(opened, Fetcher(opened.source, index=opened.index)) == {"raw"}


def test_transposed_tensor_is_one_strided_span():
    opened = open_checkpoint(str(DATA / "plain_state_dict.pt"))
    entry = opened.index.tensors["extra_transposed"]
    plan = plan_reads(opened.index, entry)
    (span,) = plan.spans
    assert span.strides == (1, 6) and not span.dense
    assert Fetcher(opened.source).byte_ranges(entry) is None  # not one run: writers fetch it
    truth = torch.load(DATA / "plain_state_dict.pt", weights_only=True)["extra_transposed"]
    assert torch.equal(Fetcher(opened.source).fetch(entry, Box((1, 1), (2, 3))), truth[1:3, 1:4])


def test_plan_values_are_frozen_and_typed(safetensors_file):
    opened = open_checkpoint(str(safetensors_file))
    plan = plan_reads(opened.index, opened.index.tensors["a"])
    assert isinstance(plan, ReadPlan) and all(isinstance(s, ReadSpan) for s in plan.spans)
    span = plan.spans[0]
    assert span.encoding is Encoding.RAW and span.encoding == "raw" and hash(Encoding.RAW) == hash("raw")
    assert (span.file, span.length, span.box) == ("model.safetensors", 48, Box((0, 0), (3, 4)))
    with pytest.raises(AttributeError):
        span.offset = 0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        plan.spans = ()  # type: ignore[misc]
    assert set(ReadSpan.__annotations__) == {
        "key",
        "piece",
        "encoding",
        "file",
        "offset",
        "length",
        "box",
        "region",
        "base",
        "strides",
        "dense",
        "refs",
    }
    assert plan.bytes_per_file() == {"model.safetensors": 48} and plan.encodings() == {"raw": 1}
    assert dataclasses.is_dataclass(Location) and Location("f", 0, 1).encoding is Encoding.RAW


def test_virtual_ref_zeros_inline_plans():
    opened = open_checkpoint(str(DATA / "fsdp2_w2"))
    index = opened.index
    w, b = index.tensors["model.embed.weight"], index.tensors["model.block.fc_in.bias"]
    parts = [Part(w.key, 15, 40), Part(None, 0, 3), Part(b.key, 2, 5)]
    virtual = flat_concat("flat", w.dtype, parts)
    fetcher = Fetcher(opened.source, index=index)
    plan = fetcher.plan(virtual)
    assert [str(s.encoding) for s in plan.spans] == ["ref", "zeros", "ref"]
    assert [(s.file, s.offset, s.length) for s in plan.spans] == [(w.key, 15, 40), ("", 0, 0), (b.key, 2, 5)]
    assert {r.key for s in plan.spans for r in s.refs} == {w.key, b.key}
    assert plan.encodings() == {"ref": 2, "zeros": 1, "raw": sum(len(r.spans) for s in plan.spans for r in s.refs)}
    want = torch.cat([fetcher.fetch(w).reshape(-1)[15:55], torch.zeros(3), fetcher.fetch(b)[2:7]])
    got = fetcher.fetch(virtual)
    assert _bits(got) == _bits(want)
    ranges = fetcher.byte_ranges(virtual)
    assert b"".join(b"\0" * n if f is None else opened.source.read(f, o, n) for f, o, n in ranges) == _bits(want)
    part = flat_slice("part", w.dtype, parts, 38, 6)  # across the zeros
    assert _bits(fetcher.fetch(part)) == _bits(want[38:44])
    step = inline_tensor("step", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    (span,) = fetcher.plan(step, Box((1, 0), (1, 2))).spans
    assert span.encoding is Encoding.INLINE and span.file == ""
    assert fetcher.fetch(step, Box((1, 0), (1, 2))).tolist() == [[3.0, 4.0]]
    assert plan_byte_ranges(fetcher.plan(step), index.tensors, step) is None  # a torch value: fetched


def _entry(*pieces: Piece, shape=(4,)) -> TensorEntry:
    return TensorEntry("model.w", "float32", shape, list(pieces))


def test_crafted_bad_pieces_give_the_exact_sentences(tmp_path):
    (tmp_path / "d.bin").write_bytes(bytes(64))
    src = LocalSource(str(tmp_path))
    root = src.label("")
    doubled = _entry(Piece(Box((0,), (3,)), Location("d.bin", 0, 12)), Piece(Box((2,), (2,)), Location("d.bin", 12, 8)))
    missing = _entry(Piece(Box((0,), (2,)), Location("d.bin", 0, 8)))
    past = _entry(Piece(Box((0,), (4,)), Location("d.bin", 0, 12)))
    cases = [
        (
            doubled,
            f"{root}: tensor model.w [4] is not tiled exactly by its pieces: elements are stored twice "
            f"(e.g. offsets [2] sizes [1]); run `ckptkit verify` for all problems",
        ),
        (
            missing,
            f"{root}: tensor model.w [4] is not tiled exactly by its pieces: 2 element(s) are in no piece "
            f"(e.g. offsets [2] sizes [2]); run `ckptkit verify` for all problems",
        ),
        (past, f"{src.label('d.bin')}: tensor model.w reads past its recorded byte range"),
        (
            _entry(Piece(FlatRange(0, 4), Location("nope", 0, 4, Encoding.REF))),
            "virtual tensor model.w refers to unknown tensor 'nope'",
        ),
        (
            _entry(Piece(Box((0,), (4,)), Location("d.bin", 0, 16, "bytes"))),
            f"{src.label('d.bin')}: unknown piece encoding 'bytes'",
        ),
    ]
    for entry, sentence in cases:
        with pytest.raises(FormatError) as planned:
            plan_reads(None, entry, label=src.label)
        assert str(planned.value) == sentence
        with pytest.raises(FormatError) as fetched:
            Fetcher(src).fetch(entry)
        assert str(fetched.value) == sentence  # fetch plans first: the same sentence, nothing read
    with pytest.raises(FormatError, match=r"d\.bin: file ends before byte 80 \(truncated\?\)"):
        plan_reads(
            None, _entry(Piece(Box((0,), (4,)), Location("d.bin", 64, 16))), label=src.label, file_sizes={"d.bin": 64}
        )
    src.close()


def test_plan_command_text_and_json(tmp_path):
    res = CliRunner().invoke(cli, ["plan", str(DATA / "fsdp2_w2"), "--tensor", "model.pos"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == f"the reads of consolidating 1 tensor(s) of dcp checkpoint {DATA / 'fsdp2_w2'}"
    assert lines[1] == "model.pos float32 [5, 10] box [0, 0]+[5, 10]: 2 span(s)"
    assert re.fullmatch(r"  raw __0_0\.distcp offset \d+ length 120 -> \[0, 0\]\+\[3, 10\]", lines[2])
    assert lines[-3:] == ["totals: 2 span(s); raw 2", "  __0_0.distcp: 120 bytes", "  __1_0.distcp: 80 bytes"]

    res = CliRunner().invoke(cli, ["plan", "--json", "--to", "3", "--tensor", "model.*", str(DATA / "fsdp2_w2")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    opened = open_checkpoint(str(DATA / "fsdp2_w2"))
    model = [k for k in opened.index.tensors if k.startswith("model.")]
    assert doc["world_size"] == 3 and {p["key"] for p in doc["plans"]} == set(model)
    pos = [p for p in doc["plans"] if p["key"] == "model.pos"]
    assert [(p["rank"], p["box"]["sizes"]) for p in pos] == [(0, [2, 10]), (1, [2, 10]), (2, [1, 10])]
    assert doc["totals"]["spans"] == sum(len(p["spans"]) for p in doc["plans"])
    assert doc["totals"]["encodings"] == {"raw": doc["totals"]["spans"]}
    assert sum(doc["totals"]["bytes_per_file"].values()) == sum(opened.index.tensors[k].nbytes for k in model)


def test_plan_command_errors_are_one_sentence(tmp_path):
    res = CliRunner().invoke(cli, ["plan", str(tmp_path / "missing")])
    assert res.exit_code == 2 and res.output.strip() == f"error: {tmp_path / 'missing'}: no such file or folder"
    res = CliRunner().invoke(cli, ["plan", str(DATA / "fsdp2_w2"), "--tensor", "nope*"])
    assert res.exit_code == 2 and res.output.strip() == f"error: {DATA / 'fsdp2_w2'}: no tensor matches --tensor nope*"


@pytest.mark.parametrize(
    "runs,why",
    [
        ([(0, 4), (4, 4)], None),  # ZeRO partitions meeting end to end
        ([(4, 4), (0, 4)], None),  # in any order
        ([(0, 4), (4, 0), (4, 4)], None),  # an empty partition (padding rank)
        ([(0, 4), (5, 3)], "in no piece"),  # a gap
        ([(0, 5), (4, 4)], "stored twice"),  # an overlap
        ([(0, 4), (4, 4), (8, 2)], "outside the tensor"),  # past the end
        ([(0, 4)], "in no piece"),  # short
    ],
)
def test_flat_pieces_tiling_fast_path_agrees_with_coverage(runs, why):
    """check_tiling's shortcut for flat pieces accepts exactly what coverage accepts, and a
    refusal still carries coverage's reason."""
    from ckptkit.index.types import FlatRange, Location, Piece, TensorEntry
    from ckptkit.runner.plan import check_tiling

    entry = TensorEntry("w", "float32", (2, 4), [Piece(FlatRange(s, n), Location("f", 0, 4 * n)) for s, n in runs])
    if why is None:
        check_tiling(entry)
        return
    with pytest.raises(FormatError, match=why):
        check_tiling(entry)


@pytest.mark.parametrize(
    "runs,why",
    [
        ([(0, 4), (5, 3)], "in no piece"),
        ([(0, 5), (4, 4)], "stored twice"),
        ([(0, 4), (4, 4), (8, 2)], "outside the tensor"),
    ],
)
def test_byte_ranges_of_flat_pieces_not_tiling_the_tensor_are_refused(tmp_path, runs, why):
    """byte_ranges takes flat runs meeting end to end as the tiling check (flat_plan.runs); any
    other flat pieces still get check_tiling's sentence, never byte ranges."""
    from ckptkit.index.types import FlatRange, Location, Piece, TensorEntry
    from ckptkit.runner.plan import Planner

    (tmp_path / "f").write_bytes(bytes(64))
    entry = TensorEntry("w", "float32", (2, 4), [Piece(FlatRange(s, n), Location("f", 4 * s, 4 * n)) for s, n in runs])
    with pytest.raises(FormatError, match=f"tensor w \\[2, 4\\] is not tiled exactly by its pieces: .*{why}"):
        Planner(None).byte_ranges(entry)
    good = TensorEntry(
        "w",
        "float32",
        (2, 4),
        [Piece(FlatRange(4, 4), Location("f", 16, 16)), Piece(FlatRange(0, 4), Location("f", 0, 16))],
    )
    assert Planner(None).byte_ranges(good) == [("f", 0, 32)]
