"""Bad input through the CLI: one clear sentence, a known exit code, no traceback, nothing left behind.

Contract (product brief): bad input gets ONE sentence on stderr starting "error: " that names the
file and what is wrong, exit 2 (verify: every problem listed, exit 1), "Traceback" never appears,
and consolidate / reshard never leave OUT, a hidden `.OUT.ckptkit-tmp-*` or a `.OUT.ckptkit-lock`.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from helpers.corrupt import (
    EXIT_ERROR,
    EXIT_PROBLEMS,
    append_bytes,
    assert_error,
    copy_fixture,
    flip_byte,
    good_header,
    leftovers,
    load_md,
    move_chunk,
    random_bytes,
    replace_storage,
    run_cli,
    run_subprocess,
    save_md,
    set_tensor_size,
    sharded_safetensors,
    storage_key,
    truncate_half,
    write_safetensors_raw,
)

COMMANDS = [
    "inspect",
    "verify",
    "consolidate",
    "reshard",
    "convert",
    "plan",
]  # plan: the structural checks, before any read


def run_cmd(cmd: str, src: Path, tmp_path: Path, *extra: str):
    """Run one command on `src`; (result, OUT path or None)."""
    if cmd in ("inspect", "verify", "plan"):
        return run_cli(cmd, str(src), *extra), None
    out = tmp_path / "OUT"
    if cmd == "consolidate":
        return run_cli("consolidate", str(src), str(out), *extra), out
    if cmd == "convert":
        return run_cli("convert", str(src), str(out), "--to", "dcp", "--world-size", "3", *extra), out
    return run_cli("reshard", str(src), str(out), "--to", "3", *extra), out


def check(cmd: str, src: Path, tmp_path: Path, *names: str, extra: tuple = ()):
    res, out = run_cmd(cmd, src, tmp_path, *extra)
    assert_error(res, *names, code=EXIT_PROBLEMS if cmd == "verify" else EXIT_ERROR, out=out)
    return res


# ---- paths that are not checkpoints -----------------------------------------------------------


def make_generic(kind: str, tmp_path: Path) -> tuple[Path, list[str]]:
    """(path, strings the message must contain)."""
    if kind == "missing":
        p = tmp_path / "does_not_exist"
        return p, [str(p), "no such file"]
    if kind == "empty_folder":
        p = tmp_path / "empty"
        p.mkdir()
        return p, [str(p), "empty"]
    if kind == "unrelated_files":
        p = tmp_path / "stuff"
        p.mkdir()
        (p / "notes.txt").write_text("hello\n")
        (p / "config.json").write_text(json.dumps({"a": 1}))
        return p, [str(p), "notes.txt"]
    if kind == "random_pt":
        p = tmp_path / "x.pt"
        p.write_bytes(random_bytes(4096))
        return p, ["x.pt", "not a torch.save archive"]
    if kind == "random_safetensors":
        p = tmp_path / "x.safetensors"
        p.write_bytes(random_bytes(4096))
        return p, ["x.safetensors", "header"]
    raise AssertionError(kind)


GENERIC = ["missing", "empty_folder", "unrelated_files", "random_pt", "random_safetensors"]


@pytest.mark.parametrize("kind", GENERIC)
@pytest.mark.parametrize("cmd", COMMANDS)
def test_not_a_checkpoint(cmd, kind, tmp_path):
    src, names = make_generic(kind, tmp_path)
    check(cmd, src, tmp_path, *names)


def test_not_a_checkpoint_end_to_end(tmp_path):
    """The same contract through a real interpreter (python -m ckptkit)."""
    src = tmp_path / "x.pt"
    src.write_bytes(random_bytes(1000))
    out = tmp_path / "OUT"
    res = run_subprocess("consolidate", str(src), str(out))
    assert_error(res, "x.pt", out=out)
    res = run_subprocess("verify", str(tmp_path / "nope"))
    assert_error(res, "nope", code=EXIT_PROBLEMS)


# ---- damaged DCP folders ----------------------------------------------------------------------


def dcp_missing_metadata(d: Path):
    (d / ".metadata").unlink()
    return [str(d), ".metadata"]


def dcp_missing_rank_file(d: Path):
    (d / "__1_0.distcp").unlink()
    return ["__1_0.distcp", "missing"]


def dcp_truncated_data(d: Path):
    truncate_half(d / "__0_0.distcp")
    return ["__0_0.distcp"]


def dcp_truncated_metadata(d: Path):
    truncate_half(d / ".metadata")
    return [".metadata"]


def dcp_random_metadata(d: Path):
    (d / ".metadata").write_bytes(random_bytes(5000))
    return [".metadata"]


def dcp_record_past_end(d: Path):
    md = load_md(d)
    mi = storage_key(md, "model.embed.weight", (19, 0))  # lives in __1_0.distcp
    info = md.storage_data[mi]
    size = (d / info.relative_path).stat().st_size
    replace_storage(md, mi, offset=size - 10, length=info.length)
    save_md(d, md)
    return [info.relative_path, "model.embed.weight", "past the end"]


def dcp_length_past_end(d: Path):
    md = load_md(d)
    mi = storage_key(md, "model.pos", (0, 0))
    info = md.storage_data[mi]
    replace_storage(md, mi, length=10**9)
    save_md(d, md)
    return [info.relative_path, "model.pos"]


def dcp_relpath_dotdot(d: Path):
    md = load_md(d)
    replace_storage(md, storage_key(md, "model.pos", (0, 0)), relative_path="../../etc/passwd")
    save_md(d, md)
    return ["../../etc/passwd", "outside"]


def dcp_relpath_absolute(d: Path):
    md = load_md(d)
    replace_storage(md, storage_key(md, "model.pos", (0, 0)), relative_path="/etc/passwd")
    save_md(d, md)
    return ["/etc/passwd", "outside"]


def dcp_relpath_dotdot_bytes_item(d: Path):
    md = load_md(d)
    replace_storage(md, storage_key(md, "extra.note"), relative_path="../../../../../../etc/hostname")
    save_md(d, md)
    return ["etc/hostname", "outside"]


def dcp_chunk_without_storage(d: Path):
    md = load_md(d)
    del md.storage_data[storage_key(md, "model.block.fc_in.weight", (4, 0))]
    save_md(d, md)
    return ["model.block.fc_in.weight", "storage record"]


def dcp_bytes_item_without_storage(d: Path):
    md = load_md(d)
    del md.storage_data[storage_key(md, "extra.note")]
    save_md(d, md)
    return ["extra.note", "storage record"]


def dcp_not_metadata_pickle(d: Path):
    """A valid (harmless) pickle that is not a Metadata object."""
    import pickle

    (d / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": 1}))
    return [".metadata", "Metadata"]


def dcp_item_not_a_tensor(d: Path):
    """A tensor chunk's bytes point at a bytes item's archive (a Python value, not a tensor)."""
    md = load_md(d)
    note = md.storage_data[storage_key(md, "extra.note")]
    mi = storage_key(md, "model.norm.bias", (0,))
    replace_storage(md, mi, relative_path=note.relative_path, offset=note.offset, length=note.length)
    save_md(d, md)
    return ["model.norm.bias"]


def dcp_item_dtype_mismatch(d: Path):
    """Metadata says one shape, the item holds another (the bytes of a different tensor)."""
    md = load_md(d)
    other = md.storage_data[storage_key(md, "model.block.fc_in.weight", (0, 0))]  # [4,10]
    mi = storage_key(md, "model.block.fc_out.weight", (0, 0))  # [5,7]
    replace_storage(md, mi, relative_path=other.relative_path, offset=other.offset, length=other.length)
    save_md(d, md)
    return ["model.block.fc_out.weight", "metadata says"]


def dcp_item_garbage_archive(d: Path):
    """A tensor record points at bytes that are a zip-looking but damaged archive."""
    md = load_md(d)
    mi = storage_key(md, "model.pos", (0, 0))
    info = md.storage_data[mi]
    blob = b"PK\x03\x04" + random_bytes(600)
    off = append_bytes(d / info.relative_path, blob)
    replace_storage(md, mi, offset=off, length=len(blob))
    save_md(d, md)
    return [info.relative_path]


DCP_CASES = {
    "missing_metadata": dcp_missing_metadata,
    "missing_rank_file": dcp_missing_rank_file,
    "truncated_distcp": dcp_truncated_data,
    "truncated_metadata": dcp_truncated_metadata,
    "random_metadata": dcp_random_metadata,
    "record_offset_past_end": dcp_record_past_end,
    "record_length_past_end": dcp_length_past_end,
    "relpath_dotdot": dcp_relpath_dotdot,
    "relpath_absolute": dcp_relpath_absolute,
    "relpath_dotdot_bytes_item": dcp_relpath_dotdot_bytes_item,
    "chunk_without_storage": dcp_chunk_without_storage,
    "bytes_item_without_storage": dcp_bytes_item_without_storage,
    "metadata_not_metadata": dcp_not_metadata_pickle,
    "item_not_a_tensor": dcp_item_not_a_tensor,
    "item_shape_mismatch": dcp_item_dtype_mismatch,
    "item_garbage_archive": dcp_item_garbage_archive,
}


@pytest.mark.parametrize("case", list(DCP_CASES))
@pytest.mark.parametrize("cmd", COMMANDS)
def test_damaged_dcp(cmd, case, tmp_path):
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    names = DCP_CASES[case](d)
    res = check(cmd, d, tmp_path, *names)
    if case.startswith("relpath"):
        # refused, not read: nothing of the outside file shows up anywhere
        assert "root:" not in res.output


def test_relpath_outside_is_never_opened(tmp_path, monkeypatch):
    """The escaping path is refused before any read: no open() of a path outside the folder."""
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.errors import CkptkitError

    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    secret = tmp_path / "secret.distcp"
    secret.write_bytes((d / "__0_0.distcp").read_bytes())  # a perfectly readable file outside
    md = load_md(d)
    replace_storage(md, storage_key(md, "model.pos", (0, 0)), relative_path="../secret.distcp")
    save_md(d, md)

    opened_paths = []
    real_open = os.open

    def spy(path, *a, **k):
        opened_paths.append(os.path.abspath(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    with pytest.raises(CkptkitError, match="outside the checkpoint folder"):
        open_checkpoint(str(d))
    assert str(secret) not in opened_paths


# ---- verify: integrity and coverage ------------------------------------------------------------


def _payload_offset(d: Path, key: str) -> tuple[str, int]:
    from ckptkit.formats.registry import open_checkpoint

    loc = open_checkpoint(str(d)).index.tensors[key].pieces[0].location
    return loc.file, loc.offset


def test_verify_deep_finds_flipped_byte(tmp_path):
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    rel, off = _payload_offset(d, "model.embed.weight")
    flip_byte(d / rel, off + 5)
    res = run_cli("verify", str(d))
    assert res.code == 0, res.output  # structure is still sound
    assert "Traceback" not in res.output
    res = run_cli("verify", "--deep", str(d))
    assert_error(res, rel, "CRC", code=EXIT_PROBLEMS)


def test_verify_lists_every_problem(tmp_path):
    """Two independent flipped payloads: both are listed."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    for key in ("model.embed.weight", "model.lm_head.weight"):
        rel, off = _payload_offset(d, key)
        flip_byte(d / rel, off + 3)
    res = run_cli("verify", "--deep", str(d))
    assert_error(res, code=EXIT_PROBLEMS)
    assert res.stderr.count("CRC") >= 2, res.stderr


def test_verify_gap_in_chunks(tmp_path):
    """The tensor grows by a row that no chunk holds."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    set_tensor_size(md, "model.pos", (6, 10))
    save_md(d, md)
    res = run_cli("verify", str(d))
    assert_error(res, "model.pos", "in no piece", code=EXIT_PROBLEMS)


def test_verify_overlapping_chunks(tmp_path):
    """model.pos [5,10]: chunk rows 0..2 and 3..4; move the second to rows 2..3 and shrink to 4 rows."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    move_chunk(md, "model.pos", (3, 0), (2, 0))
    set_tensor_size(md, "model.pos", (4, 10))
    save_md(d, md)
    res = run_cli("verify", str(d))
    assert_error(res, "model.pos", "twice", code=EXIT_PROBLEMS)


def test_verify_overlap_and_gap(tmp_path):
    """Second chunk moved up a row: row 2 doubled and row 4 missing; both reported."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    move_chunk(md, "model.pos", (3, 0), (2, 0))
    save_md(d, md)
    res = run_cli("verify", str(d))
    assert_error(res, "model.pos", "twice", "in no piece", code=EXIT_PROBLEMS)


def test_verify_chunk_outside_tensor(tmp_path):
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    move_chunk(md, "model.pos", (3, 0), (4, 0))  # rows 4..5 of a 5-row tensor
    save_md(d, md)
    res = run_cli("verify", str(d))
    assert_error(res, "model.pos", code=EXIT_PROBLEMS)
    assert "outside" in res.stderr or "in no piece" in res.stderr, res.stderr


@pytest.mark.parametrize("cmd", ["consolidate", "reshard"])
def test_gap_is_refused_by_writers(cmd, tmp_path):
    """A tensor with rows in no chunk cannot be written out (it would be filled with garbage)."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    set_tensor_size(md, "model.pos", (6, 10))
    save_md(d, md)
    check(cmd, d, tmp_path, "model.pos")


@pytest.mark.parametrize(
    "cmd",
    [
        "consolidate",
        "reshard",
    ],
)
def test_overlap_plus_gap_is_refused_by_writers(cmd, tmp_path):
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    md = load_md(d)
    move_chunk(md, "model.pos", (3, 0), (2, 0))
    save_md(d, md)
    check(cmd, d, tmp_path, "model.pos")


def test_damaged_compressed_item_leaves_nothing(tmp_path):
    """The zstd fixture's items are decoded only while writing: a damaged stream fails mid-write,
    and the temporary output must still be removed."""
    pytest.importorskip("zstandard")
    d = copy_fixture("dcp_zstd_w2", tmp_path, "ckpt")
    md = load_md(d)
    mi = storage_key(md, "model.embed.weight", (0, 0))
    info = md.storage_data[mi]
    with open(d / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00" * min(64, info.length))
    for cmd in ("consolidate", "reshard"):
        res, out = run_cmd(cmd, d, tmp_path)
        assert_error(res, info.relative_path, out=out)
    res = run_cli("verify", "--deep", str(d))
    assert_error(res, "model.embed.weight", code=EXIT_PROBLEMS)


# ---- damaged safetensors ------------------------------------------------------------------------


def st_header_too_long(p: Path):
    header, data = good_header()
    write_safetensors_raw(p, header, data, header_len=10**6)
    return ["header length"]


def st_header_not_json(p: Path):
    write_safetensors_raw(p, b"{this is not json" + b" " * 20, b"\x00" * 40)
    return ["not valid JSON"]


def st_header_not_object(p: Path):
    write_safetensors_raw(p, b"[1, 2, 3]", b"")
    return ["JSON object"]


def st_offsets_past_end(p: Path):
    header, data = good_header()
    header["b"]["data_offsets"] = [24, 4000]
    header["b"]["shape"] = [994]
    write_safetensors_raw(p, header, data)
    return ["tensor b", "data_offsets"]


def st_dtype_shape_mismatch(p: Path):
    header, data = good_header()
    header["a"]["dtype"] = "F64"  # [2,3] float64 needs 48 bytes, the span is 24
    write_safetensors_raw(p, header, data)
    return ["tensor a", "24"]


def st_overlap(p: Path):
    header, data = good_header()
    header["b"] = {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}
    write_safetensors_raw(p, header, data)
    return ["overlap", "a and b"]


def st_unknown_dtype(p: Path):
    header, data = good_header()
    header["a"]["dtype"] = "Q7"
    write_safetensors_raw(p, header, data)
    return ["tensor a", "Q7"]


def st_negative_shape(p: Path):
    header, data = good_header()
    header["a"]["shape"] = [-2, -3]
    write_safetensors_raw(p, header, data)
    return ["tensor a", "shape"]


def st_too_short(p: Path):
    p.write_bytes(b"\x01\x02\x03")
    return ["too short"]


ST_CASES = {
    "header_too_long": st_header_too_long,
    "header_not_json": st_header_not_json,
    "header_not_object": st_header_not_object,
    "offsets_past_end": st_offsets_past_end,
    "dtype_shape_mismatch": st_dtype_shape_mismatch,
    "overlap": st_overlap,
    "unknown_dtype": st_unknown_dtype,
    "negative_shape": st_negative_shape,
    "too_short": st_too_short,
}


ST_BUGS: dict[str, str] = {}  # known bugs, as strict xfails (none open)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=[pytest.mark.xfail(reason=ST_BUGS[c], strict=True)] if c in ST_BUGS else [])
        for c in ST_CASES
    ],
)
@pytest.mark.parametrize("cmd", COMMANDS)
def test_damaged_safetensors_file(cmd, case, tmp_path):
    p = tmp_path / "model.safetensors"
    names = ST_CASES[case](p)
    check(cmd, p, tmp_path, "model.safetensors", *names)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_damaged_safetensors_in_folder(cmd, tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    st_overlap(d / "model.safetensors")
    check(cmd, d, tmp_path, "model.safetensors", "overlap")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_sharded_safetensors_missing_shard(cmd, tmp_path):
    d = sharded_safetensors(tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    check(cmd, d, tmp_path, "model-00002-of-00002.safetensors", "missing")


@pytest.mark.parametrize("cmd", ["inspect", "verify", "consolidate"])
def test_sharded_safetensors_index_names_absent_tensor(cmd, tmp_path):
    d = sharded_safetensors(tmp_path)
    doc = json.loads((d / "model.safetensors.index.json").read_text())
    doc["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(doc))
    check(cmd, d, tmp_path, "model.safetensors.index.json", "c")


@pytest.mark.parametrize(
    "bad", ["{not json", json.dumps({"weight_map": ["x"]}), json.dumps({"weight_map": {"a": "../outside.safetensors"}})]
)
@pytest.mark.parametrize("cmd", ["inspect", "verify", "consolidate"])
def test_sharded_safetensors_bad_index(cmd, bad, tmp_path):
    d = sharded_safetensors(tmp_path)
    (d / "model.safetensors.index.json").write_text(bad)
    check(cmd, d, tmp_path, "model.safetensors.index.json")


# ---- damaged torch.save files -------------------------------------------------------------------


def test_sanity_plain_fixture_consolidates(tmp_path):
    """Control: the undamaged fixture goes through (so the damaged cases fail for the damage)."""
    src = copy_fixture("plain_state_dict.pt", tmp_path)
    res = run_cli("consolidate", str(src), str(tmp_path / "OUT"))
    assert res.code == 0, res.output
    assert leftovers(tmp_path / "OUT") == []


@pytest.mark.parametrize("cmd", COMMANDS)
def test_truncated_pt(cmd, tmp_path):
    src = copy_fixture("plain_state_dict.pt", tmp_path)
    truncate_half(src)
    check(cmd, src, tmp_path, "plain_state_dict.pt")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_zip_that_is_not_torch_save(cmd, tmp_path):
    src = tmp_path / "notes.pt"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("readme.txt", "just a zip\n")
    check(cmd, src, tmp_path, "notes.pt", "data.pkl")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_zip_without_pt_suffix(cmd, tmp_path):
    src = tmp_path / "archive.zip"
    with zipfile.ZipFile(src, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    check(cmd, src, tmp_path, "archive.zip")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_legacy_torch_save(cmd, tmp_path):
    src = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, src, _use_new_zipfile_serialization=False)
    check(cmd, src, tmp_path, "legacy.pt", "legacy")


@pytest.mark.parametrize("cmd", ["inspect", "verify", "consolidate"])
def test_pt_storage_missing_from_archive(cmd, tmp_path):
    """A torch.save archive whose data/<key> member is gone."""
    src = tmp_path / "w.pt"
    torch.save({"w": torch.ones(3)}, src)
    fixed = tmp_path / "fixed.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(fixed, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if "/data/" not in info.filename:
                zout.writestr(info, zin.read(info.filename))
    check(cmd, fixed, tmp_path, "fixed.pt")


# ---- options that contradict the checkpoint ------------------------------------------------------


def test_reshard_wrong_from(tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path)
    out = tmp_path / "OUT"
    res = run_cli("reshard", str(src), str(out), "--to", "4", "--from", "3")
    assert_error(res, "fsdp2_w2", "2", "3", out=out)
    assert "--from" in res.stderr


def test_reshard_to_zero(tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path)
    out = tmp_path / "OUT"
    res = run_cli("reshard", str(src), str(out), "--to", "0")
    assert_error(res, "--to", out=out)


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_reshard_safetensors(kind, tmp_path):
    if kind == "folder":
        src = sharded_safetensors(tmp_path)
    else:
        from safetensors.torch import save_file

        src = tmp_path / "model.safetensors"
        save_file({"a": torch.ones(2)}, str(src))
    out = tmp_path / "OUT"
    res = run_cli("reshard", str(src), str(out), "--to", "2")
    assert_error(res, str(src), "safetensors", out=out)


def test_reshard_torch_save(tmp_path):
    src = copy_fixture("plain_state_dict.pt", tmp_path)
    out = tmp_path / "OUT"
    res = run_cli("reshard", str(src), str(out), "--to", "2")
    assert_error(res, "plain_state_dict.pt", out=out)


@pytest.mark.parametrize("cmd", ["consolidate", "reshard"])
def test_existing_nonempty_out_untouched(cmd, tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path)
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    args = [cmd, str(src), str(out)] + (["--to", "3"] if cmd == "reshard" else [])
    res = run_cli(*args)
    assert_error(res, str(out), "exists", out=out, out_should_exist=True)
    assert sorted(os.listdir(out)) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("cmd", ["consolidate", "reshard"])
def test_out_is_an_existing_file(cmd, tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path)
    out = tmp_path / "OUT"
    out.write_text("precious")
    args = [cmd, str(src), str(out)] + (["--to", "3"] if cmd == "reshard" else [])
    res = run_cli(*args)
    assert_error(res, str(out), out=out, out_should_exist=True)
    assert out.read_text() == "precious"


@pytest.mark.parametrize("cmd", ["consolidate", "reshard"])
def test_out_parent_missing(cmd, tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path)
    out = tmp_path / "no" / "such" / "OUT"
    args = [cmd, str(src), str(out)] + (["--to", "3"] if cmd == "reshard" else [])
    res = run_cli(*args)
    assert_error(res, str(out.parent), out=out)


@pytest.mark.parametrize("cmd", ["consolidate", "reshard"])
def test_out_locked_by_live_run(cmd, tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path)
    out = tmp_path / "OUT"
    lock = tmp_path / ".OUT.ckptkit-lock"
    lock.write_text(str(os.getpid()))  # a live process holds it
    args = [cmd, str(src), str(out)] + (["--to", "3"] if cmd == "reshard" else [])
    res = run_cli(*args)
    assert_error(res, "lock")
    assert not out.exists()
    assert lock.read_text() == str(os.getpid())  # someone else's lock is not removed
    assert [n for n in os.listdir(tmp_path) if "ckptkit-tmp" in n] == []


@pytest.mark.parametrize("size", ["banana", "0", "-5GB", "5XB", ""])
def test_bad_max_shard_size(size, tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path)
    out = tmp_path / "OUT"
    res = run_cli("consolidate", str(src), str(out), "--max-shard-size", size)
    assert_error(res, repr(size), out=out)


@pytest.mark.parametrize("dtype", ["int8", "banana", "bool"])
def test_bad_dtype(dtype, tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path)
    out = tmp_path / "OUT"
    res = run_cli("consolidate", str(src), str(out), "--dtype", dtype)
    assert_error(res, dtype, "--dtype", out=out)


@pytest.mark.parametrize("budget", ["banana", "0"])
@pytest.mark.parametrize("cmd", ["verify", "consolidate", "reshard"])
def test_bad_memory_budget(cmd, budget, tmp_path):
    src = copy_fixture("fsdp2_w2", tmp_path)
    res, out = run_cmd(cmd, src, tmp_path, "--memory-budget", budget)
    assert_error(res, repr(budget), out=out)


def test_damaged_dcp_end_to_end(tmp_path):
    """Two damaged-DCP cases through a real interpreter."""
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    (d / "__1_0.distcp").unlink()
    out = tmp_path / "OUT"
    res = run_subprocess("reshard", str(d), str(out), "--to", "3")
    assert_error(res, "__1_0.distcp", out=out)
    assert res.stderr.startswith("error: ")


# ---- DCP metadata whose fields have the wrong types (crafted / hostile metadata) -----------------


def _md_edit(fn):
    def craft(d: Path):
        md = load_md(d)
        fn(md)
        save_md(d, md)

    return craft


def _chunk_rank_mismatch(md):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md.state_dict_metadata["model.pos"].chunks[1] = ChunkStorageMetadata(
        offsets=torch.Size([3]), sizes=torch.Size([2, 10])
    )
    info = md.storage_data.pop(storage_key(md, "model.pos", (3, 0)))
    md.storage_data[MetadataIndex("model.pos", torch.Size([3]), 0)] = info


def _metadata_is_a_folder(d: Path):
    (d / ".metadata").unlink()
    (d / ".metadata").mkdir()


def _distcp_is_a_folder(d: Path):
    (d / "__1_0.distcp").unlink()
    (d / "__1_0.distcp").mkdir()


MALFORMED_MD = {
    # case: (craft, strings the message must name)
    "chunks_not_a_list": (
        _md_edit(lambda md: setattr(md.state_dict_metadata["model.pos"], "chunks", 5)),
        ["model.pos"],
    ),
    "chunk_rank_mismatch": (_md_edit(_chunk_rank_mismatch), ["model.pos"]),
    "size_not_ints": (
        _md_edit(lambda md: setattr(md.state_dict_metadata["model.pos"], "size", ("a", "b"))),
        ["model.pos"],
    ),
    "negative_tensor_size": (_md_edit(lambda md: set_tensor_size(md, "model.pos", (-5, 10))), ["model.pos"]),
    "storage_data_not_a_dict": (
        _md_edit(lambda md: setattr(md, "storage_data", list(md.storage_data.items()))),
        [".metadata"],
    ),
    "planner_data_not_a_dict": (_md_edit(lambda md: setattr(md, "planner_data", 5)), [".metadata"]),
    "storage_offset_not_int": (
        _md_edit(lambda md: replace_storage(md, storage_key(md, "model.pos", (0, 0)), offset="abc")),
        ["model.pos"],
    ),
    "relpath_is_the_folder": (
        _md_edit(lambda md: replace_storage(md, storage_key(md, "model.pos", (0, 0)), relative_path=".")),
        ["model.pos"],
    ),
    "unknown_transform": (
        _md_edit(lambda md: replace_storage(md, storage_key(md, "model.pos", (0, 0)), transform_descriptors=["bogus"])),
        ["model.pos", "bogus"],
    ),
    "metadata_is_a_folder": (_metadata_is_a_folder, [".metadata"]),
    "distcp_is_a_folder": (_distcp_is_a_folder, ["__1_0.distcp"]),
}

MALFORMED_BUGS: dict[str, tuple] = {}  # known bugs, as strict xfails (none open)


def _malformed_params():
    out = []
    for case in MALFORMED_MD:
        for cmd in COMMANDS:
            bug = MALFORMED_BUGS.get(case)
            marks = [pytest.mark.xfail(reason=bug[1], strict=True)] if bug and cmd in bug[0] else []
            out.append(pytest.param(cmd, case, marks=marks, id=f"{cmd}-{case}"))
    return out


@pytest.mark.parametrize("cmd,case", _malformed_params())
def test_malformed_metadata_fields(cmd, case, tmp_path):
    d = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
    craft, names = MALFORMED_MD[case]
    craft(d)
    extra = ("--deep",) if cmd == "verify" else ()
    res = check(cmd, d, tmp_path, *names, extra=extra)
    if case.endswith("is_a_folder"):
        assert "folder" in res.stderr or "director" in res.stderr, res.stderr


# ---- --overwrite never destroys the old output when the new one fails ----------------------------


@pytest.mark.parametrize("cmd", ["consolidate", "reshard"])
@pytest.mark.parametrize("when", ["reading", "writing"])
def test_failed_overwrite_keeps_old_output(cmd, when, tmp_path):
    if when == "reading":
        src = copy_fixture("fsdp2_w2", tmp_path, "ckpt")
        (src / "__1_0.distcp").unlink()
        names = ["__1_0.distcp"]
    else:  # a damaged zstd item fails only once bytes are decoded, mid-write
        pytest.importorskip("zstandard")
        src = copy_fixture("dcp_zstd_w2", tmp_path, "ckpt")
        md = load_md(src)
        info = md.storage_data[storage_key(md, "model.embed.weight", (0, 0))]
        with open(src / info.relative_path, "r+b") as f:
            f.seek(info.offset)
            f.write(b"\x00" * min(64, info.length))
        names = [info.relative_path]
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "keep.txt").write_text("previous result")
    args = [cmd, str(src), str(out), "--overwrite"] + (["--to", "3"] if cmd == "reshard" else [])
    res = run_cli(*args)
    assert_error(res, *names, out=out, out_should_exist=True)
    assert sorted(os.listdir(out)) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "previous result"
