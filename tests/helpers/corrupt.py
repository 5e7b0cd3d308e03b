"""Shared helpers for the bad-input and hostile-pickle tests.

Everything here crafts damaged or hostile checkpoints from copies of the real fixtures (never the
fixtures themselves) and runs the CLI, checking the error contract: one "error: ..." sentence on
stderr, a known exit code, no traceback, and no output / temp folder / lock left behind.

The test side may use torch's own pickle on the fixtures: they are trusted files we generated.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "fixtures" / "data"

EXIT_PROBLEMS = 1
EXIT_ERROR = 2


# ---- running the CLI ------------------------------------------------------------------------


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    exception: BaseException | None = None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_cli(*args: str) -> Result:
    """Run `ckptkit ARGS` in process (click's CliRunner)."""
    from ckptkit_cli.main import cli

    runner = CliRunner()
    res = runner.invoke(cli, [str(a) for a in args], catch_exceptions=True)
    exc = res.exception if not isinstance(res.exception, SystemExit) else None
    return Result(res.exit_code, res.stdout, res.stderr, exc)


def run_subprocess(*args: str, cwd: str | None = None) -> Result:
    """Run `python -m ckptkit ARGS` in a fresh interpreter (end-to-end)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", *[str(a) for a in args]],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def leftovers(out: Path) -> list[str]:
    """Hidden temp siblings and locks ckptkit may have left next to `out`."""
    parent = out.parent
    if not parent.is_dir():
        return []
    prefix = f".{out.name}.ckptkit-"
    old = f"{out.name}.ckptkit-old-"
    return sorted(n for n in os.listdir(parent) if n.startswith(prefix) or n.startswith(old))


def assert_error(
    res: Result, *names: str, code: int = EXIT_ERROR, out: Path | None = None, out_should_exist: bool = False
) -> None:
    """The error contract: exit code, one 'error: ' sentence naming `names`, no traceback, no output."""
    detail = f"exit {res.code}\n--- stdout ---\n{res.stdout}\n--- stderr ---\n{res.stderr}"
    assert res.exception is None, f"uncaught exception {res.exception!r}\n{detail}"
    assert "Traceback" not in res.output, detail
    assert "internal error" not in res.output, detail
    assert res.code == code, detail
    if code == EXIT_ERROR:
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1, f"expected one error line\n{detail}"
        assert lines[0].startswith("error: "), detail
    else:  # verify: a header line and one line per problem
        assert "problem" in res.stderr, detail
    # verify's header line repeats SRC; the names must appear in the problem lines themselves
    body = res.stderr if code == EXIT_ERROR else "\n".join(res.stderr.splitlines()[1:])
    for name in names:
        assert name in body, f"message does not name {name!r}\n{detail}"
    if out is not None:
        if not out_should_exist:
            assert not out.exists(), f"{out} was left behind\n{detail}"
        assert leftovers(out) == [], f"left behind: {leftovers(out)}\n{detail}"


# ---- crafting DCP folders --------------------------------------------------------------------


def copy_fixture(name: str, tmp_path: Path, as_name: str | None = None) -> Path:
    src = DATA / name
    dst = tmp_path / (as_name or name)
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)
    return dst


def load_md(folder: Path, name: str = ".metadata"):
    """The DCP Metadata object, via torch's own pickle (trusted fixture, test side only)."""
    with open(folder / name, "rb") as f:
        return pickle.load(f)


def save_md(folder: Path, md, name: str = ".metadata") -> None:
    with open(folder / name, "wb") as f:
        pickle.dump(md, f)


def storage_key(md, fqn: str, offsets=None):
    """The MetadataIndex of `fqn` (the chunk at `offsets`, or the first one) in storage_data."""
    for mi in md.storage_data:
        if mi.fqn == fqn and (offsets is None or tuple(mi.offset or ()) == tuple(offsets)):
            return mi
    raise KeyError(fqn)


def replace_storage(md, mi, **changes) -> None:
    """Replace fields of a _StorageInfo (a frozen dataclass in some torch versions)."""
    import dataclasses

    info = md.storage_data[mi]
    md.storage_data[mi] = dataclasses.replace(info, **changes)


def move_chunk(md, fqn: str, old_offsets, new_offsets) -> None:
    """Move a tensor chunk in both state_dict_metadata and storage_data (same bytes)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    meta = md.state_dict_metadata[fqn]
    for i, ch in enumerate(meta.chunks):
        if tuple(ch.offsets) == tuple(old_offsets):
            meta.chunks[i] = ChunkStorageMetadata(offsets=torch.Size(new_offsets), sizes=ch.sizes)
            break
    else:
        raise KeyError(old_offsets)
    mi = storage_key(md, fqn, old_offsets)
    info = md.storage_data.pop(mi)
    md.storage_data[MetadataIndex(fqn, torch.Size(new_offsets), mi.index)] = info


def set_tensor_size(md, fqn: str, size) -> None:
    import dataclasses

    meta = md.state_dict_metadata[fqn]
    try:
        meta.size = torch.Size(size)
    except dataclasses.FrozenInstanceError:
        md.state_dict_metadata[fqn] = dataclasses.replace(meta, size=torch.Size(size))


def append_bytes(path: Path, data: bytes) -> int:
    """Append `data` to a file; the offset where it starts."""
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(data)
    return offset


def torch_save_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def random_bytes(n: int, seed: int = 1234) -> bytes:
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(n))
    # never start like a zip, a pickle or a legacy torch file by accident
    return b"\x17\x42" + data[2:]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ---- crafting safetensors --------------------------------------------------------------------


def write_safetensors_raw(path: Path, header: dict | bytes, data: bytes, header_len: int | None = None) -> None:
    """A safetensors file from an explicit header (dict or raw bytes) and data buffer."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(hb) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + hb + data)


def good_header() -> tuple[dict, bytes]:
    """A valid two-tensor header (float32 [2,3] and [4]) and its 40-byte buffer."""
    header = {
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]},
    }
    data = torch.arange(10, dtype=torch.float32).numpy().tobytes()
    return header, data


def sharded_safetensors(tmp: Path) -> Path:
    """`tmp/hf`: two safetensors shards (a [2, 3], b [4]) and the index naming them."""
    from safetensors.torch import save_file

    d = tmp / "hf"
    d.mkdir()
    save_file({"a": torch.ones(2, 3)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(4)}, str(d / "model-00002-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": 40},
                "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
            }
        )
    )
    return d
