"""A save that the system stops (a file-size limit, a full disk, an I/O error, a forbidden or
read-only place) is one sentence, never torch's CheckpointException dump: torch wraps every rank's
failure (and torch.save turns the OSError into a RuntimeError that keeps it only as its context);
ckptkit unwraps it to the cause and words it as every output error. Nothing is committed, nothing
is left, and the Checkpointer saves and restores afterwards."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.errors import CkptkitError, OutputError
from ckptkit.framework_errors import framework_cause

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 100_000  # bytes any file may grow to: the model's weights (256 KB) do not fit

_UNDER_A_LIMIT = textwrap.dedent("""
    import json, os, resource, signal, sys
    import torch, ckptkit
    from ckptkit.errors import CkptkitError

    run, mode, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    ckpt = ckptkit.Checkpointer(run, async_save=(mode == "async"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    report = {}
    try:
        if mode == "api":
            ckptkit.save({"w": model.weight.detach()}, os.path.join(run, "api_out"))
        else:
            ckpt.save(1, model)
            ckpt.wait()
        report["refused"] = None
    except CkptkitError as exc:   # anything else: a traceback, and the test fails
        report["refused"] = str(exc)
    report["steps"] = ckpt.steps()
    report["left"] = sorted(os.listdir(run)) if os.path.isdir(run) else []
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    ckpt.save(1, model)
    ckpt.wait()
    fresh = torch.nn.Linear(256, 256)
    report["restored"] = ckptkit.Checkpointer(run).restore(fresh)
    report["equal"] = torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    print(json.dumps(report))
""")


@pytest.mark.parametrize("mode", ["sync", "async", "api"])
def test_a_save_past_the_file_size_limit_is_one_sentence_and_commits_nothing(tmp_path, mode):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-c", _UNDER_A_LIMIT, str(run), mode, str(LIMIT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    detail = f"exit {res.returncode}\n--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-3000:]}"
    assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr, detail
    report = json.loads(res.stdout.strip().splitlines()[-1])
    refused = report["refused"]
    assert refused is not None, detail
    assert "\n" not in refused and "CheckpointException" not in refused and "inline_container" not in refused, refused
    assert os.strerror(errno.EFBIG) in refused and "nothing was written" in refused, refused
    assert report["steps"] == [] and report["left"] == [], report  # nothing committed, nothing left
    assert report["restored"] == 1 and report["equal"], report  # and usable after


def _failing_write(code: int):
    """torch's per-item writer, failing as the system would with `code`."""

    def write(*_args, **_kwargs):
        raise OSError(code, os.strerror(code))

    return write


ERRNOS = [errno.EIO, errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT]


@pytest.mark.parametrize("code", ERRNOS, ids=[errno.errorcode[c] for c in ERRNOS])
def test_torch_wraps_a_system_error_and_the_checkpointer_words_it(tmp_path, monkeypatch, code):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.api import CheckpointException

    model = torch.nn.Linear(4, 4)
    with monkeypatch.context() as patch:
        patch.setattr(filesystem, "_write_item", _failing_write(code))
        with pytest.raises(CheckpointException):  # what torch itself raises: the wrapper
            dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
        for async_save in (False, True):
            ckpt = ckptkit.Checkpointer(str(tmp_path / f"run{int(async_save)}"), async_save=async_save)
            with pytest.raises(OutputError) as refused:
                ckpt.save(1, model)
                ckpt.wait()
            message = str(refused.value)
            assert "\n" not in message and "Traceback" not in message, message
            assert os.strerror(code).lower() in message.lower() and "nothing was written" in message, message
            assert ckpt.steps() == [] and os.listdir(ckpt.directory) == []
    for async_save in (False, True):
        ckpt = ckptkit.Checkpointer(str(tmp_path / f"run{int(async_save)}"), async_save=async_save)
        ckpt.save(1, model)
        ckpt.wait()
        assert ckpt.steps() == [1]


def test_framework_cause_opens_nested_wrappers_in_rank_order():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def raised(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:
            return caught

    full = raised(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    inner = CheckpointException("write_data", {1: _wrap_exception(full)})
    outer = CheckpointException("save", {3: _wrap_exception(raised(ValueError("other"))), 0: _wrap_exception(inner)})
    assert framework_cause(outer) is full  # the OSError, though rank 3 failed too
    bug = raised(ValueError("a bug"))
    assert framework_cause(CheckpointException("save", {0: _wrap_exception(bug)})) is bug  # no dump, no guess
    ours = CkptkitError("a sentence")
    context = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    context.__context__ = ours
    assert framework_cause(context) is ours  # torch.save's RuntimeError, opened
    loop_a, loop_b = RuntimeError("a"), RuntimeError("b")
    loop_a.__context__, loop_b.__context__ = loop_b, loop_a
    assert framework_cause(loop_a) is loop_a  # a chain that loops ends
    plain = KeyError("k")
    assert framework_cause(plain) is plain
