"""Shared fixtures: paths to the real checkpoints in fixtures/data and their ground truth."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "fixtures" / "data"

DCP_FIXTURES = ["fsdp2_w2", "fsdp2_w3", "fsdp1_sharded_w2", "dcp_rank_local_w2", "dcp_zstd_w2"]


def has_zstd() -> bool:
    try:
        import zstandard  # noqa: F401  (availability check)

        return True
    except ImportError:
        return False


def dcp_params():
    out = []
    for name in DCP_FIXTURES:
        marks = []
        if name == "dcp_zstd_w2" and not has_zstd():
            marks.append(pytest.mark.skip(reason="reading zstd-compressed DCP items needs the zstandard package"))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def load_truth(name: str) -> dict:
    """Ground truth written at save time through torch's full-state-dict APIs (trusted file)."""
    return torch.load(DATA / f"{name}.truth.pt", weights_only=True)


def dataclass_fields(value: object) -> list[tuple[str, object]]:
    """Every field of a dataclass instance, in order, as (name, value): what `vars` gave before the
    index's dataclasses had slots (an unset slot raises here, as a missing key would)."""
    return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]


def assert_tensor_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert torch.equal(actual, expected), f"{what}: values differ"


def save_random_dcp(path, count: int, shape: tuple[int, int], seed: int, name: str = "w{i}") -> dict:
    """A one-process DCP checkpoint of `count` random float32 tensors under "model" (all in one data
    file), written by torch's dcp.save; returns the state it saved."""
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(seed)
    state = {"model": {name.format(i=i): torch.randn(*shape, generator=gen) for i in range(count)}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def read_all(path) -> tuple:
    """Open a checkpoint with ckptkit and materialise every tensor (small fixtures only)."""
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.runner.fetch import Fetcher

    opened = open_checkpoint(str(path))
    fetcher = Fetcher(opened.source)
    tensors = {k: fetcher.fetch(t) for k, t in opened.index.tensors.items()}
    objects = {k: o.value for k, o in opened.index.objects.items()}
    return opened, tensors, objects


def torchrun_cmd(nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
    ]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def pytest_addoption(parser) -> None:
    """The differential oracle's run length and seed (tests/hostile/test_differential_oracle.py)."""
    parser.addoption(
        "--examples",
        type=int,
        default=None,
        help="mutants per operator for the differential oracle (default: the CI run's)",
    )
    parser.addoption("--oracle-seed", type=int, default=0, help="the differential oracle's seed (default 0)")


def pytest_collection_modifyitems(config, items) -> None:
    """Files with the most multi-process (slow) tests first, the rest in their usual order: with
    `--dist loadfile` (scripts/test.sh) a worker takes a whole file, and a long file handed out last
    would leave the other workers idle while it runs."""
    slow_per_file: dict[str, int] = {}
    for item in items:
        slow_per_file.setdefault(item.nodeid.split("::")[0], 0)
        if item.get_closest_marker("slow") is not None:
            slow_per_file[item.nodeid.split("::")[0]] += 1
    items.sort(key=lambda item: -slow_per_file[item.nodeid.split("::")[0]])


def saved_checkpointer_step(tmp_path: Path) -> tuple:
    """(Checkpointer, model, optimizer, step folder): a Checkpointer directory holding step 1 of a
    tiny model + AdamW, saved by this one process (torch seeded with 0 first)."""
    import ckptkit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    ck = ckptkit.Checkpointer(str(tmp_path / "run"))
    ck.save(1, model, optim)
    return ck, model, optim, tmp_path / "run" / "step_000000001"
