"""A careless user and an attacker against fsspec URLs as SRC and OUT, file:// URLs, and loading a
bare model state dict (what they share and the contract: tests/helpers/cli_contract.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ckptkit
from ckptkit.errors import CkptkitError
from helpers.cli_contract import DATA, PLAIN, ROOT, one_sentence as _one_sentence, run_ckptkit as _ckptkit


# ---- URLs as SRC and OUT ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["diff", str(PLAIN)]])
def test_an_unknown_protocol_as_src_is_one_sentence(command):
    res = _ckptkit(*command, "nosuchproto://bucket/ckpt")
    _one_sentence(res)
    assert "nosuchproto://bucket/ckpt" in res.stderr


def test_a_zip_url_that_names_no_archive_is_one_sentence(tmp_path):
    res = _ckptkit("inspect", "zip://x", cwd=str(tmp_path))
    _one_sentence(res)


def test_load_from_an_unknown_protocol_is_a_ckptkit_error():
    with pytest.raises(CkptkitError, match="nosuchproto"):
        ckptkit.load({"w": torch.zeros(3)}, "nosuchproto://bucket/ckpt")


def test_a_file_url_naming_a_torch_save_file_reads_like_its_path(tmp_path):
    by_path = _ckptkit("inspect", "--json", PLAIN)
    assert by_path.returncode == 0, by_path.stderr
    res = _ckptkit("inspect", "--json", f"file://{PLAIN}", cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"format": "torch_save"' in res.stdout


def test_load_from_a_file_url_naming_a_file(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.arange(3.0)}, path)
    state = ckptkit.load({"w": torch.zeros(3)}, f"file://{path}")
    assert torch.equal(state["w"], torch.arange(3.0))


def test_load_from_a_file_url_naming_a_file_equals_load_from_its_path(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.arange(3.0)}, path)
    by_path = ckptkit.load({"model": {"w": torch.zeros(3)}}, str(path))
    by_url = ckptkit.load({"model": {"w": torch.zeros(3)}}, f"file://{path}")
    assert torch.equal(by_url["model"]["w"], torch.arange(3.0))
    assert torch.equal(by_url["model"]["w"], by_path["model"]["w"])


def test_an_unknown_protocol_is_the_same_sentence_as_src_and_as_out(tmp_path):
    """SRC and OUT go through one helper (storage/url_fs.filesystem): the same words both ways."""
    as_src = _ckptkit("inspect", "nosuchproto://bucket/ckpt")
    as_out = _ckptkit("consolidate", PLAIN, "nosuchproto://bucket/ckpt", cwd=str(tmp_path))
    for res in (as_src, as_out):
        _one_sentence(res)
    assert "not known to fsspec" in as_src.stderr
    assert as_src.stderr == as_out.stderr


def test_a_known_protocol_whose_package_is_missing_names_the_package(monkeypatch):
    """fsspec's known_implementations names the package a protocol needs: the sentence says which."""
    from fsspec.registry import known_implementations

    from ckptkit.storage.source import open_source

    monkeypatch.setitem(
        known_implementations,
        "ckptkitnopkg",
        {"class": "ckptkit_no_such_package.FS", "err": "install ckptkit_no_such_package"},
    )
    with pytest.raises(CkptkitError, match=r"^ckptkitnopkg://b/c: .*ckptkit_no_such_package") as err:
        open_source("ckptkitnopkg://b/c")
    assert "pip install ckptkit_no_such_package" in str(err.value)


def test_a_refused_connection_says_the_connection_failed():
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/ckpt"
    res = _ckptkit("inspect", url)
    _one_sentence(res)
    assert url in res.stderr and "connection failed" in res.stderr
    assert "no such file" not in res.stderr


@pytest.mark.parametrize("command", [["inspect"], ["verify"]])
def test_an_s3_src_without_credentials_is_one_sentence(command, tmp_path):
    pytest.importorskip("s3fs", reason="needs s3fs (pip install -e '.[dev]')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # no credentials anywhere
    env.update(
        {
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_EC2_METADATA_DISABLED": "true",
            "FSSPEC_S3_ENDPOINT_URL": "http://127.0.0.1:1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
    )
    res = subprocess.run(
        [sys.executable, "-m", "ckptkit", *command, "s3://ckptkit-none/ckpt"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    _one_sentence(res)
    assert "s3://ckptkit-none/ckpt" in res.stderr and "credentials" in res.stderr.lower()


def test_a_backend_error_while_reading_names_the_file_and_the_backend_message():
    """An error an fsspec backend raises reading a file (a permission, a dropped connection) is a
    CkptkitError naming the file and carrying the backend's words, not the backend's exception."""
    import fsspec

    from ckptkit.errors import FormatError
    from ckptkit.storage.source import open_source

    fs = fsspec.filesystem("memory")
    fs.pipe("/ckptkit-backend-error/a.bin", b"0123456789")
    try:
        src = open_source("memory://ckptkit-backend-error")

        def refuse(*args, **kwargs):
            raise PermissionError("AccessDenied by the bucket policy")

        src.fs = type(
            "Refusing", (), {"cat_file": staticmethod(refuse), "ls": staticmethod(refuse), "size": staticmethod(refuse)}
        )()
        for call in (lambda: src.read("a.bin", 0, 4), lambda: src.listdir(""), lambda: src.size("a.bin")):
            with pytest.raises(
                FormatError, match=r"^memory://ckptkit-backend-error.*AccessDenied by the bucket policy"
            ):
                call()
    finally:
        fs.rm("/ckptkit-backend-error", recursive=True)


def test_a_file_url_naming_a_file_verifies_and_consolidates_like_its_path(tmp_path):
    url = f"file://{PLAIN}"
    res = _ckptkit("verify", url, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    by_url, by_path = tmp_path / "by_url", tmp_path / "by_path"
    assert _ckptkit("consolidate", url, by_url, cwd=str(tmp_path)).returncode == 0
    assert _ckptkit("consolidate", PLAIN, by_path, cwd=str(tmp_path)).returncode == 0
    assert sorted(p.name for p in by_url.iterdir()) == sorted(p.name for p in by_path.iterdir())
    for p in by_path.iterdir():
        assert (by_url / p.name).read_bytes() == p.read_bytes(), p.name


# ---- write errors other than a full disk ----------------------------------------------------------


@pytest.mark.parametrize("source", [PLAIN, DATA / "deepspeed" / "z3_bf16_w2"], ids=["torch.save", "zero3"])
def test_a_bare_model_state_dict_loads_what_model_keys_load(source):
    """`ckptkit.load(model.state_dict(), ...)`: the checkpoint's model.<fqn> tensors, as
    {"model": model.state_dict()} gets them."""
    from ckptkit.api import loadable
    from ckptkit.formats.registry import open_checkpoint

    index, _ = loadable(open_checkpoint(str(source)))
    shapes = {k[len("model.") :]: e for k, e in index.tensors.items() if k.startswith("model.")}
    assert shapes
    dtype = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "int64": torch.int64,
        "int32": torch.int32,
        "bool": torch.bool,
    }

    def zeros() -> dict:
        return {k: torch.zeros(e.shape, dtype=dtype[e.dtype]) for k, e in shapes.items()}

    bare = ckptkit.load(zeros(), str(source))
    nested = ckptkit.load({"model": zeros()}, str(source))["model"]
    assert set(bare) == set(nested)
    assert all(torch.equal(bare[k], nested[k]) for k in bare)
    assert any(bool(v.any()) for v in bare.values())  # (filled, not left at zero)
