"""Remote storage through fsspec against a real S3-protocol server on loopback (moto in server
mode) with s3fs: inspect, verify, consolidate, reshard and convert from and to a bucket; reads
are byte ranges; outputs commit with a marker written last and readers honour it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import DATA, ROOT, free_port, save_random_dcp, subprocess_env

moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (pip install -e '.[dev]')")
s3fs = pytest.importorskip("s3fs", reason="needs s3fs (pip install -e '.[dev]')")

BUCKET = "ckpts"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1, a bucket with fsdp2_w2 uploaded, and the environment that
    points s3fs at it (the standard variables: AWS_* credentials, FSSPEC_S3_ENDPOINT_URL)."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=env["FSSPEC_S3_ENDPOINT_URL"])
    fs.mkdir(BUCKET)
    fs.put(str(DATA / "fsdp2_w2"), f"{BUCKET}/fsdp2_w2", recursive=True)
    yield fs, env
    server.stop()


def _ckptkit(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit", *args],
        cwd=ROOT,
        env={**subprocess_env(), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_commands_read_from_and_write_to_a_bucket(s3, tmp_path):
    fs, env = s3
    src = f"s3://{BUCKET}/fsdp2_w2"
    res = _ckptkit(env, "inspect", src)
    assert res.returncode == 0 and "world size  2" in res.stdout, res.stderr
    assert _ckptkit(env, "verify", "--deep", src).returncode == 0
    for cmd, out, extra in (
        ("reshard", "w3", ["--to", "3"]),
        ("consolidate", "hf", []),
        ("convert", "t", ["--to", "torch"]),
    ):
        res = _ckptkit(env, cmd, src, f"s3://{BUCKET}/{out}", *extra)
        assert res.returncode == 0, res.stderr
        names = fs.ls(f"{BUCKET}/{out}", detail=False)
        assert f"{BUCKET}/{out}/.ckptkit-complete" in names and f"{BUCKET}/{out}/.ckptkit-incomplete" not in names
        # what landed in the bucket equals the same command run locally
        local = tmp_path / out
        assert _ckptkit(env, cmd, src, str(local), *extra).returncode == 0
        back = tmp_path / f"{out}-back"
        fs.get(f"{BUCKET}/{out}", str(back), recursive=True)
        for p in local.rglob("*"):
            if p.is_file() and p.name != ".metadata":
                assert (back / p.relative_to(local)).read_bytes() == p.read_bytes(), p.name
    res = _ckptkit(env, "diff", src, f"s3://{BUCKET}/w3")
    assert res.returncode == 0, res.stdout + res.stderr
    again = _ckptkit(env, "reshard", src, f"s3://{BUCKET}/w3", "--to", "3")
    assert again.returncode == 2 and "exists" in again.stderr


def test_an_unfinished_remote_output_is_refused(s3):
    fs, env = s3
    fs.put(str(DATA / "fsdp2_w2"), f"{BUCKET}/half", recursive=True)
    fs.pipe(f"{BUCKET}/half/.ckptkit-incomplete", b"x")
    for cmd, code in ((["inspect"], 2), (["verify"], 1), (["reshard"], 2)):
        extra = [f"s3://{BUCKET}/x", "--to", "3"] if cmd == ["reshard"] else []
        res = _ckptkit(env, *cmd, f"s3://{BUCKET}/half", *extra)
        assert res.returncode == code and "unfinished ckptkit output" in res.stderr, res.stderr


def test_a_failed_remote_write_leaves_nothing_that_loads(s3, tmp_path):
    fs, env = s3
    res = _ckptkit(
        env, "reshard", str(DATA / "fsdp2_w2"), f"s3://{BUCKET}/fail", "--to", "3", "--memory-budget", "not-a-size"
    )
    assert res.returncode == 2
    res = _ckptkit(env, "convert", str(DATA / "fsdp2_w2"), f"s3://{BUCKET}/fail2", "--to", "zero2")
    assert res.returncode == 2 and "--ds-config" in res.stderr
    assert not fs.exists(f"{BUCKET}/fail2/.ckptkit-complete") and not fs.exists(f"{BUCKET}/fail2/.metadata")


def test_reads_are_byte_ranges(s3, monkeypatch, tmp_path):
    """Indexing reads metadata and zip directories; a tensor is read as its own byte range: no
    whole-file download of a data file that holds several tensors."""
    import fsspec
    import torch

    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.runner.fetch import Fetcher
    from ckptkit.storage import source as source_mod

    fs, env = s3
    state = save_random_dcp(tmp_path / "big", 4, (256, 1024), seed=0)  # 4 x 1 MiB, one file
    fs.put(str(tmp_path / "big"), f"{BUCKET}/big", recursive=True)
    monkeypatch.setitem(
        fsspec.config.conf, "s3", {"endpoint_url": env["FSSPEC_S3_ENDPOINT_URL"], "key": "testing", "secret": "testing"}
    )
    calls: list[tuple[str, int, int]] = []
    original = source_mod.FsspecSource.read

    def counting(self, rel, offset, length):
        calls.append((rel, offset, length))
        return original(self, rel, offset, length)

    monkeypatch.setattr(source_mod.FsspecSource, "read", counting)
    monkeypatch.setattr(
        source_mod.FsspecSource,
        "readinto",
        lambda self, rel, offset, buf: buf.__setitem__(slice(None), counting(self, rel, offset, len(buf))),
    )
    opened = open_checkpoint(f"s3://{BUCKET}/big")
    total = sum(opened.index.files.values())
    assert sum(n for _, _, n in calls) < total / 20  # the index: metadata and zip directories
    calls.clear()
    got = Fetcher(opened.source, index=opened.index).fetch(opened.index.tensors["model.w2"])
    assert torch.equal(got, state["model"]["w2"])
    data = opened.index.tensors["model.w2"].pieces[0].location.file
    assert sum(n for _, _, n in calls) <= (1 << 20) + 4096 < opened.index.files[data] / 3
