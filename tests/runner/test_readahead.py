"""The reshard's disk pacing (runner/readahead.py, RenameOutput.start_writeback): the source is
asked for at most a window ahead of the bytes written, all of it by the end; the output's open
files (never a closed one) are written back early; what is written and when it is committed do
not change, and a failed run leaves no output and no thread behind."""

from __future__ import annotations

import errno
import filecmp
import os
import threading
import time

import pytest

from ckptkit.context import RunContext
from ckptkit.errors import OutputError
from ckptkit.formats.registry import open_checkpoint
from ckptkit.ops.reshard import reshard
from ckptkit.progress import NullProgress
from ckptkit.runner import readahead
from ckptkit.runner.distributed import Group
from ckptkit.runner.readahead import ReadAhead, data_spans
import ckptkit.ops.reshard as reshard_op
from ckptkit.storage import rename_output
from ckptkit.storage.output import open_output
from conftest import DATA

SRC = str(DATA / "fsdp2_w2")


class _Hints:
    """os.posix_fadvise replaced: (fd, offset, length, advice) of every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, fd: int, offset: int, length: int, advice: int) -> None:
        with self.lock:
            self.calls.append((fd, offset, length, advice))

    def asked(self, fd: int) -> int:
        with self.lock:
            return sum(n for f, _o, n, a in self.calls if f == fd and a == os.POSIX_FADV_WILLNEED)


class _Recorder(NullProgress):
    def __init__(self) -> None:
        self.advanced = 0
        self.totals: list[int] = []

    def advance(self, n: int) -> None:
        self.advanced += n

    def retotal(self, total: int) -> None:
        self.totals.append(total)


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def hints(monkeypatch) -> _Hints:
    h = _Hints()
    monkeypatch.setattr(readahead.os, "posix_fadvise", h)
    return h


def test_reads_ahead_within_the_window_then_everything(hints, monkeypatch):
    monkeypatch.setattr(readahead, "STEP", 256)
    opened = open_checkpoint(SRC)
    spans = data_spans(opened.index)
    total = opened.index.total_tensor_bytes
    window = 1024
    assert len(spans) == 2 and total > 4 * window  # two rank files, several windows long
    inner = _Recorder()
    with ReadAhead(opened.source, opened.index, RunContext(memory_budget=window, progress=inner)) as run_ctx:
        fds = {rel: opened.source.fileno(rel) for rel in spans}
        wanted = {rel: (hi - lo) * window // total for rel, (lo, hi) in spans.items()}
        _wait_for(lambda: all(hints.asked(fds[rel]) >= wanted[rel] for rel in spans), "the first window")
        time.sleep(0.2)  # nothing more comes before the copy moves on
        for rel in spans:
            assert hints.asked(fds[rel]) <= wanted[rel] + 256 + 1, rel
        run_ctx.progress.retotal(total)
        run_ctx.progress.advance(total)
        _wait_for(lambda: all(hints.asked(fds[rel]) == hi - lo for rel, (lo, hi) in spans.items()), "every byte")
    assert inner.advanced == total and inner.totals == [total]  # the caller's progress saw it all
    for fd, offset, _n, _a in hints.calls:  # tensor bytes only, front to back
        rel = next(r for r, f in fds.items() if f == fd)
        assert spans[rel][0] <= offset < spans[rel][1]
    assert not [t for t in threading.enumerate() if t.name == "ckptkit-readahead"]


def test_no_read_ahead_for_a_rank_of_a_distributed_run(hints):
    opened = open_checkpoint(SRC)
    ctx = RunContext(group=Group(0, 2))
    with ReadAhead(opened.source, opened.index, ctx) as run_ctx:
        assert run_ctx is ctx
    assert hints.calls == []


def test_writeback_flushes_open_files_only(tmp_path, hints):
    with open_output(str(tmp_path / "out")) as out:
        done = out.open("a.bin")
        done.write(b"a" * 5000)
        done.close()
        with out.open("b.bin") as f:
            f.write(b"b" * 5000)
            f.flush()
            fd = f.fileno()
            out.start_writeback()
            assert hints.calls == [(fd, 0, 0, os.POSIX_FADV_DONTNEED)]
            f.write(b"c")
    assert (tmp_path / "out" / "a.bin").read_bytes() == b"a" * 5000
    assert (tmp_path / "out" / "b.bin").read_bytes() == b"b" * 5000 + b"c"


class _Off:
    """ReadAhead switched off: the block runs with the caller's context."""

    def __init__(self, source, index, ctx, output=None) -> None:
        self.ctx = ctx

    def __enter__(self) -> RunContext:
        return self.ctx

    def __exit__(self, *exc) -> None:
        return None


def test_reshard_paced_writes_the_same_bytes(tmp_path, monkeypatch, hints):
    plain, paced = tmp_path / "plain", tmp_path / "paced"
    with monkeypatch.context() as off:
        off.setattr(reshard_op, "ReadAhead", _Off)
        reshard(SRC, str(plain), 3)
    assert hints.calls == []
    flushed: list[int] = []
    monkeypatch.setattr(readahead, "FLUSH", 1)  # the writeback starts as soon as the copy moves
    real_flush = rename_output.RenameOutput.start_writeback
    monkeypatch.setattr(
        rename_output.RenameOutput,
        "start_writeback",
        lambda self: (flushed.append(len(self._open_files)), real_flush(self)),
    )
    real_advance, advances = readahead._Counting.advance, []

    def advance(self, n: int) -> None:  # a worker advancing for the second time waits for a writeback
        real_advance(self, n)
        advances.append(n)
        if len(advances) > 1:
            _wait_for(lambda: flushed, "a writeback started while the workers copy")

    monkeypatch.setattr(readahead._Counting, "advance", advance)
    reshard(SRC, str(paced), 3, ctx=RunContext(memory_budget=1 << 20, workers=2))
    assert len(advances) > 1 and max(flushed) >= 1  # files being written were flushed
    assert any(a == os.POSIX_FADV_WILLNEED for *_x, a in hints.calls)
    names = sorted(p.name for p in plain.iterdir())
    assert names == sorted(p.name for p in paced.iterdir())
    for name in names:
        assert filecmp.cmp(plain / name, paced / name, shallow=False), name


def test_a_failed_paced_reshard_leaves_no_output_and_no_thread(tmp_path, monkeypatch):
    real_advance, advances = readahead._Counting.advance, []

    def failing(self, n: int) -> None:  # the third bytes copied fail, while the thread runs
        advances.append(n)
        if len(advances) == 3:
            raise OSError(errno.EIO, "Input/output error")
        real_advance(self, n)

    monkeypatch.setattr(readahead._Counting, "advance", failing)
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="Input/output error while the output was being made; nothing was written"):
        reshard(SRC, str(out), 3, ctx=RunContext(workers=2))  # (the system's error, worded: exit 2, not a bug's 3)
    assert len(advances) >= 3
    assert os.listdir(tmp_path) == []  # no output, no temporary folder, no lock
    assert not [t for t in threading.enumerate() if t.name == "ckptkit-readahead"]
