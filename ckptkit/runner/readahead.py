"""Keeping the disk busy during a copy: the source read ahead, the output written back early.

A reshard's workers alternate between reading (a CRC pass over a zip member, a slab) and work
that leaves the disk idle (the CRC itself, copying from the page cache, headers), and every
output byte reaches the disk only at its file's fsync, after the last copy. This VM's disk
serves reads and writes in turn, so each idle moment adds to the wall time: on 1.2 GB reshards
the source took 1.0-1.6 s to read where 0.6 s sufficed with reads kept in flight, and the writes
began only after the last copy.

A `ReadAhead` runs one background thread beside the executor that (1) asks the kernel
(posix_fadvise WILLNEED: a hint; nothing enters the process) for each source data file's tensor
bytes, front to back, at most `window` bytes (the memory budget) ahead of the copy, and (2) every
FLUSH bytes copied, starts the writeback of the output's open files (the output's
`start_writeback`), so their fsync at close waits for less. Neither changes what is written nor
when it is durable: each file is still fsynced before the output is committed.

How far the copy got is told by the progress count: a reshard takes each output rank's share of
every tensor in order, so it reads every source data file at about the same pace, and a file is
read ahead in proportion to the bytes written. Only a local, one-process run reads ahead (a rank
of a distributed run reads a share of the files).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..context import RunContext
    from ..index.types import CheckpointIndex
    from ..storage.source import Source

STEP = 8 << 20  # bytes asked for at a time, file after file (one readahead request's worth)
WAIT_S = 0.05  # how long the thread sleeps when it is a window ahead (advances also wake it)
FLUSH = 64 << 20  # bytes written between two starts of the output's writeback


class _Counting:
    """A Progress that forwards everything and counts the bytes advanced."""

    def __init__(self, inner, moved: threading.Condition) -> None:
        self._inner = inner
        self._moved = moved
        self.done = 0
        self.total = 0
        self.wake_at = 0  # the read-ahead thread is woken when `done` reaches this
        self._count_lock = threading.Lock()

    def start(self, total: int, desc: str) -> None:
        self._inner.start(total, desc)

    def advance(self, n: int) -> None:
        with self._count_lock:  # workers advance at once
            self.done += n
            wake = self.done >= self.wake_at
        self._inner.advance(n)
        if wake:
            with self._moved:
                self._moved.notify()

    def close(self) -> None:
        self._inner.close()

    def retotal(self, total: int) -> None:
        self.total = total
        fix = getattr(self._inner, "retotal", None)
        if fix is not None:
            fix(total)


def data_spans(index: CheckpointIndex) -> dict[str, tuple[int, int]]:
    """Each source file's first and last tensor byte (a file's header and objects are left out)."""
    spans: dict[str, tuple[int, int]] = {}
    for entry in index.tensors.values():
        for piece in entry.pieces:
            loc = piece.location
            if loc is None or loc.length <= 0:
                continue
            end = loc.offset + loc.length
            lo_hi = spans.get(loc.file)
            spans[loc.file] = (loc.offset, end) if lo_hi is None else (min(lo_hi[0], loc.offset), max(lo_hi[1], end))
    return spans


class ReadAhead:
    """`with ReadAhead(source, index, ctx, output) as run_ctx:` the block runs with `run_ctx` (ctx
    with a counting progress) while the source is read ahead and `output` (if it has
    `start_writeback`) written back; the thread is gone when the block ends. Nothing happens for
    a source without descriptors (a URL) or a distributed run."""

    def __init__(self, source: Source, index: CheckpointIndex, ctx: RunContext, output: object = None) -> None:
        self._source = source
        self._writeback = getattr(output, "start_writeback", None)
        self._index = index
        self._ctx = ctx
        self._window = max(STEP, ctx.memory_budget)
        self._stop = threading.Event()
        self._moved = threading.Condition()
        self._thread: threading.Thread | None = None
        self._progress: _Counting | None = None

    def __enter__(self) -> RunContext:
        if not hasattr(self._source, "fileno") or self._ctx.group.distributed or not hasattr(os, "posix_fadvise"):
            return self._ctx
        self._progress = _Counting(self._ctx.progress, self._moved)
        self._progress.total = self._index.total_tensor_bytes
        self._thread = threading.Thread(target=self._run, name="ckptkit-readahead", daemon=True)
        self._thread.start()
        return dataclasses.replace(self._ctx, progress=self._progress)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        with self._moved:
            self._moved.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        if hasattr(signal, "pthread_sigmask"):  # Ctrl-C belongs to the main thread (as the executor's workers)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._read_ahead()
        except Exception:  # a hint only: the copy reads whatever was not read ahead
            return

    def _read_ahead(self) -> None:
        progress = self._progress
        assert progress is not None
        files = [(rel, lo, hi) for rel, (lo, hi) in sorted(data_spans(self._index).items()) if hi > lo]
        fds = [self._source.fileno(rel) for rel, _lo, _hi in files]
        asked = [lo for _rel, lo, _hi in files]
        flushed = 0  # progress when the output's writeback was last started
        while not self._stop.is_set():
            total = max(1, progress.total)
            done = progress.done
            ahead = min(1.0, (done + self._window) / total)  # the fraction of each file wanted
            more = False
            for i, (_rel, lo, hi) in enumerate(files):
                want = lo + int((hi - lo) * ahead)
                if asked[i] < want and not self._stop.is_set():
                    n = min(STEP, want - asked[i])
                    os.posix_fadvise(fds[i], asked[i], n, os.POSIX_FADV_WILLNEED)
                    asked[i] += n
                    more = True
            if done - flushed >= FLUSH and self._writeback is not None:
                flushed = done
                self._writeback()
            progress.wake_at = min(done + max(STEP, self._window // 4), flushed + FLUSH)
            if not more:
                with self._moved:
                    self._moved.wait(WAIT_S)
