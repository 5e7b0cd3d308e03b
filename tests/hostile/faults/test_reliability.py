"""Faults: damage inside compressed items, a full disk, and fuzzed inputs for every parser.
(Crafted pickles: test_safeload.py, test_cli_bad_input.py, test_code_in_deepspeed_pickles.py; kills:
test_crash.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ckptkit.errors import CkptkitError
from ckptkit.formats.registry import open_checkpoint
from ckptkit.ops.verify import verify
from ckptkit.runner.fetch import Fetcher
from conftest import DATA, ROOT, has_zstd, save_random_dcp, subprocess_env
from helpers.ds_fixtures import ds_fixtures


def _ckptkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(not has_zstd(), reason="reading zstd-compressed DCP items needs the zstandard package")
def test_damage_inside_a_compressed_item_is_caught(tmp_path):
    """A zstd frame without a content checksum decodes damaged bytes silently; the torch.save
    archive inside carries CRC32s, which ckptkit checks after decoding."""
    src = tmp_path / "src"
    shutil.copytree(DATA / "dcp_zstd_w2", src)
    item = next(
        p
        for p in open_checkpoint(str(src)).index.tensors["model.embed.weight"].pieces
        if p.location.file == "__1_0.distcp"
    ).location
    with open(src / item.file, "r+b") as f:
        f.seek(item.offset + item.length // 2)
        b = f.read(8)
        f.seek(item.offset + item.length // 2)
        f.write(bytes(x ^ 0xFF for x in b))
    res = _ckptkit("reshard", str(src), str(tmp_path / "out"), "--to", "3")
    assert res.returncode == 2 and "__1_0.distcp" in res.stderr and "Traceback" not in res.stderr
    assert "CRC32" in res.stderr or "zstd" in res.stderr
    assert not (tmp_path / "out").exists()
    _, problems = verify(str(src), deep=True)
    assert any("model.embed.weight" in p for p in problems)


def test_a_second_writer_of_the_same_output_is_refused(tmp_path):
    """While one run holds OUT's lock (here: this test process, inside open_output), another run
    writing the same OUT refuses instead of interleaving; the first still commits."""
    from ckptkit.storage.output import open_output

    out = tmp_path / "out"
    with open_output(str(out)) as first:
        first.write_bytes("marker", b"first")
        res = _ckptkit("reshard", str(DATA / "fsdp2_w2"), str(out), "--to", "3", "--overwrite")
        assert res.returncode == 2 and "another ckptkit run is writing this output" in res.stderr, res.stderr
    assert (out / "marker").read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- a full disk -----------------------------------------------------------------------------


def _tmpfs(size: str):
    """A tmpfs of `size` (root only); the test is skipped where mounting is not allowed."""
    where = tempfile.mkdtemp(prefix="ckptkit-tmpfs-")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], capture_output=True, text=True
    )
    if proc.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs ({proc.stderr.strip() or 'mount failed'}; needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", where], capture_output=True)
        os.rmdir(where)


@pytest.fixture()
def tiny_disk():
    yield from _tmpfs("2m")


@pytest.fixture()
def other_disk():
    yield from _tmpfs("64m")


@pytest.fixture(scope="module")
def four_mb_dcp(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "src"
    save_random_dcp(path, 4, (256, 1024), seed=1)  # 4 MiB
    return path


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "cmd",
    [["consolidate"], ["reshard", "--to", "3"], ["convert", "--to", "torch"]],
    ids=["consolidate", "reshard", "convert"],
)
def test_a_full_disk_is_one_sentence_and_leaves_nothing(tiny_disk, four_mb_dcp, cmd):
    out = os.path.join(tiny_disk, "out")
    res = _ckptkit(cmd[0], str(four_mb_dcp), out, *cmd[1:])
    assert res.returncode == 2, res.stderr
    assert "no space left" in res.stderr and "Traceback" not in res.stderr
    assert os.listdir(tiny_disk) == []  # no OUT, no temporary folder, no lock


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_output_on_another_filesystem(other_disk, four_mb_dcp):
    """copy_file_range refuses to cross filesystems on many kernels: the bytes take the buffered
    path and the output is the same."""
    from ckptkit.ops.diff import diff

    for cmd in (["reshard", "--to", "3"], ["consolidate"], ["convert", "--to", "torch"]):
        out = os.path.join(other_disk, cmd[0])
        res = _ckptkit(cmd[0], str(four_mb_dcp), out, *cmd[1:])
        assert res.returncode == 0, res.stderr
        assert diff(str(four_mb_dcp), out).equal, cmd


# ---- fuzzing ---------------------------------------------------------------------------------


def _targets() -> list[tuple[str, str]]:
    """(checkpoint to copy, file inside it to damage): every parser ckptkit has."""
    out = [
        ("fsdp2_w2", ".metadata"),
        ("fsdp2_w2", "__0_0.distcp"),
        ("plain_state_dict.pt", ""),
        ("dcp_rank_local_w2", "__1.metadata"),
    ]
    if has_zstd():
        out.append(("dcp_zstd_w2", "__1_0.distcp"))
    if "z2_bf16_w2" in ds_fixtures():
        out += [
            ("deepspeed/z2_bf16_w2", "global_step2/mp_rank_00_model_states.pt"),
            ("deepspeed/z3_bf16_w2", "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ]
    return out


def _safetensors_target(tmp: str) -> tuple[str, str]:
    from safetensors.torch import save_file

    path = os.path.join(tmp, "st_seed.safetensors")
    if not os.path.exists(path):
        save_file(
            {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
            path,
            metadata={"format": "pt"},
        )
    return path, ""


mutation = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(1, 16)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True), st.just(0)),
    st.tuples(st.just("insert"), st.floats(0, 1, exclude_max=True), st.integers(1, 64)),
    st.tuples(st.just("zero"), st.floats(0, 1, exclude_max=True), st.integers(1, 256)),
)


def _damage(path: str, kind: str, where: float, n: int, rnd: bytes) -> None:
    data = bytearray(open(path, "rb").read())
    pos = int(where * len(data))
    if kind == "flip":
        for i in range(pos, min(len(data), pos + n)):
            data[i] ^= rnd[i % len(rnd)] | 1
    elif kind == "truncate":
        del data[pos:]
    elif kind == "insert":
        data[pos:pos] = (rnd * (n // len(rnd) + 1))[:n]
    else:
        data[pos : pos + n] = bytes(min(n, len(data) - pos))
    open(path, "wb").write(bytes(data))


def _read_everything(path: str) -> None:
    opened = open_checkpoint(path)
    fetcher = Fetcher(opened.source, index=opened.index)
    for entry in opened.index.tensors.values():
        fetcher.fetch(entry)
    verify(path, deep=True)


@pytest.mark.slow
@settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(target=st.integers(0, 100), mut=mutation, rnd=st.binary(min_size=1, max_size=8))
@example(target=1, mut=("flip", 0.999, 1), rnd=b"\x00")  # found by CI: a zip directory entry at a negative offset
def test_fuzzed_files_give_ckptkit_errors_only(target, mut, rnd):
    """Damaged copies of real files of every format: reading, fetching every tensor and deep
    verification raise nothing but CkptkitError (no crash, no hang, no other exception)."""
    base = os.path.join(tempfile.gettempdir(), "ckptkit-fuzz")
    os.makedirs(base, exist_ok=True)
    targets = _targets() + [None]
    choice = targets[target % len(targets)]
    work = os.path.join(base, uuid.uuid4().hex[:8])
    try:
        if choice is None:
            seed, inner = _safetensors_target(base)
            ckpt = os.path.join(work, "x.safetensors")
            os.makedirs(work)
            shutil.copy(seed, ckpt)
            victim = ckpt
        else:
            name, inner = choice
            src = DATA / name
            ckpt = os.path.join(work, os.path.basename(name))
            if src.is_dir():
                shutil.copytree(src, ckpt)
                victim = os.path.join(ckpt, inner)
            else:
                os.makedirs(work)
                shutil.copy(src, ckpt)
                victim = ckpt
        _damage(victim, *mut, rnd)
        try:
            _read_everything(ckpt)
        except CkptkitError:
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
