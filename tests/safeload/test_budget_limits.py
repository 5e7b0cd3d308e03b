"""Every allocation a pickle can cause is charged to one account that follows --memory-budget and
the file's size, and a value is cut to what will be shown before it is expanded.

Crafted as an attacker would, several shapes each: many small objects (empty dicts, empty lists,
stand-ins), bytes rebuilt by a grammar rule (bytearray, bytes), pathlib paths from thousands of
long parts, and a value referencing one long string thousands of times (printed and --json). Each
runs through the CLI under tests/helpers/hostile.py: refused in one sentence (or, for the shared string,
shown cut) within max(budget, 2 x file) + 100 MB, under --memory-budget 64MB.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import hostile
from helpers.memory_craft import save_dcp

from ckptkit import safeload
from ckptkit.errors import CkptkitError
from ckptkit.runner import limits

BUDGET = "64MB"
BUDGET_BYTES = 64 * 10**6
TIMEOUT = 120.0


def _archive(pickle_bytes: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
    return out.getvalue()


# ---- many small objects --------------------------------------------------------------------------


def empty_dicts(size: int = 10 * 10**6) -> bytes:
    return b"\x80\x04](" + b"}" * (size - 6) + b"e."


def empty_lists(size: int = 10 * 10**6) -> bytes:
    return b"\x80\x02](" + b"]" * (size - 6) + b"e."


def empty_tuples_in_lists(size: int = 10 * 10**6) -> bytes:
    return b"\x80\x02](" + b"](e" * ((size - 6) // 3) + b"e."


# ---- bytes a rule builds (a 3 KB file) -------------------------------------------------------------


def bytearrays(count: int = 240) -> bytes:
    """bytearray(1 MiB), called `count` times through one memoized global (within the fixed
    256 MiB MAX_PICKLE_BUILT: the budget bounds it)."""
    return b"\x80\x02](cbuiltins\nbytearray\nq\x01" + b"h\x01J\x00\x00\x10\x00\x85R" * count + b"e."


def bytes_from_one_text(count: int = 240) -> bytes:
    """bytearray(text, 'latin-1') of one 1 MB text fetched `count` times from the memo."""
    return (
        b"\x80\x02](cbuiltins\nbytearray\nq\x01X\x00\x00\x10\x00"
        + b"x" * (1 << 20)
        + b"q\x02X\x07\x00\x00\x00latin-1q\x030"
        + b"h\x01h\x02h\x03\x86R" * count
        + b"e."
    )


def pathlib_parts(parts: int = 3000, length: int = 60_000) -> bytes:
    """A path made of one 60 KB string fetched thousands of times (74-249 KB files)."""
    return (
        b"\x80\x02cpathlib\nPurePosixPath\nq\x00X"
        + length.to_bytes(4, "little")
        + b"a" * length
        + b"q\x010("
        + b"h\x01" * parts
        + b"tR."
    )


def pathlib_many(paths: int = 2000, length: int = 40_000) -> bytes:
    """Many paths, each of a few copies of one long part."""
    return (
        b"\x80\x02](cpathlib\nPurePosixPath\nq\x00X"
        + length.to_bytes(4, "little")
        + b"b" * length
        + b"q\x010"
        + b"h\x00(h\x01h\x01h\x01tR" * paths
        + b"e."
    )


MANY = [empty_dicts, empty_lists, empty_tuples_in_lists]
BUILT = [bytearrays, bytes_from_one_text, pathlib_parts, pathlib_many]


def _torch_save(tmp_path: Path, pickle_bytes: bytes) -> Path:
    path = tmp_path / "model.pt"
    path.write_bytes(_archive(pickle_bytes))
    return path


def _dcp_metadata(tmp_path: Path, pickle_bytes: bytes) -> Path:
    folder = tmp_path / "ck"
    save_dcp(folder, {"w": torch.arange(4.0)})
    (folder / ".metadata").write_bytes(pickle_bytes)
    return folder / ".metadata"


def _refused(src: Path, hostile_file: Path, cmd: str = "inspect") -> None:
    scene = hostile.Scene(src)
    run = hostile.run_ckptkit(cmd, src, "--memory-budget", BUDGET, timeout=TIMEOUT)
    bound = hostile.rss_bound(
        BUDGET_BYTES, hostile_file.stat().st_size, with_torch=cmd != "inspect"
    )  # (inspect: no torch)
    hostile.check_refused(run, hostile_file.name, scene=scene, rss_limit=bound)


@pytest.mark.parametrize("craft", MANY, ids=lambda f: f.__name__)
def test_many_small_objects_in_a_metadata_stay_within_the_budget(craft, tmp_path):
    md = _dcp_metadata(tmp_path, craft())
    _refused(md.parent, md)


@pytest.mark.parametrize("craft", MANY[:1] + BUILT, ids=lambda f: f.__name__)
def test_a_torch_save_pickle_stays_within_the_budget(craft, tmp_path):
    path = _torch_save(tmp_path, craft())
    _refused(path, path)


@pytest.mark.parametrize("craft", BUILT, ids=lambda f: f.__name__)
def test_the_account_follows_the_budget_in_the_library_too(craft):
    """Under a 64 MB budget the machine refuses in one sentence naming the file; under 4 GB the
    bytes rules stay within their own limits (a path of 4096 characters at most in any case)."""
    limits.set_budget(BUDGET_BYTES)
    try:
        with pytest.raises(CkptkitError, match=r"^x\.pt: "):
            safeload.restricted_loads(craft(), "x.pt")
    finally:
        limits.set_budget(None)


def test_a_value_sharing_one_long_string_is_cut_before_it_is_expanded(tmp_path):
    """A dict value referencing one 60 KB string 10,000 times: inspect prints its first 100
    characters and --json writes a bounded document, both within the bound (was 1.2 GB / 600 MB)."""
    text = "z" * 60_000
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(4.0), "extra": [text] * 10_000}, path)  # (the pickler fetches it from its memo)
    assert path.stat().st_size < 200_000
    bound = hostile.rss_bound(BUDGET_BYTES, path.stat().st_size, with_torch=False)
    shown = hostile.run_ckptkit("inspect", path, "--memory-budget", BUDGET, timeout=TIMEOUT)
    assert shown.code == 0 and shown.peak_rss <= bound, shown.detail()
    line = next(ln for ln in shown.stdout.splitlines() if ln.strip().startswith("extra ="))
    assert line.strip() == "extra = ['" + "z" * 98, line[:200]  # (the value's first 100 characters)
    as_json = hostile.run_ckptkit("inspect", "--json", path, "--memory-budget", BUDGET, timeout=TIMEOUT)
    assert as_json.code == 0 and as_json.peak_rss <= bound, as_json.detail()
    assert len(as_json.stdout) < 40 << 20 and '"__cut__"' in as_json.stdout or '"__chars__"' in as_json.stdout
