"""Stopping a run cleanly on Ctrl-C: at points chosen in advance, never in the middle of cleanup.

Python's own Ctrl-C raises KeyboardInterrupt wherever the main thread happens to be: inside a
`finally` that removes a temporary folder, at the entry of an `__exit__` (which is then skipped),
while a traceback keeps a memoryview alive that a closing mmap trips over (BufferError), or
inside torch's import, whose C++ start-up cannot pass an exception on and aborts the process.
Worker threads never see it at all and keep copying. So the command line (cli/entry.py) installs
its own handler and this module gives it what it needs:

- while nothing needs cleaning up (no output is open) a Ctrl-C ends the process at once;
- while an output is open (`needs_cleanup`), a Ctrl-C only sets `cancelled`; every thread stops
  at its next `check()` (a slab, a copied range, the executor's wait) by raising `Cancelled`,
  and the output's `__exit__` removes what was written. An output whose `with` block ends after
  a Ctrl-C is abandoned, not committed;
- once an output is committed (`committed`), the command has done its work: a later Ctrl-C is
  ignored and the command ends with its summary and exit 0. So exit 130 always means no output.

The library alone installs no handler: in a training process Ctrl-C keeps Python's meaning, and
`cancelled` is never set.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

cancelled = threading.Event()  # set by the command line's Ctrl-C handler
committed = threading.Event()  # an output was committed: the command's work is done, Ctrl-C ignored
_open = [0]  # outputs (and launchers) that must clean up before the process ends
_open_lock = threading.Lock()
_local = threading.local()  # .stop: the executor's per-run event, set when a sibling job failed

T = TypeVar("T")


class Cancelled(KeyboardInterrupt):
    """Ctrl-C was pressed; raised at a check point so the run unwinds through its cleanup."""


class Stopped(Exception):
    """Another job of the same run failed; this one stops (the executor reports the other's error)."""


def check() -> None:
    """A point where this thread may stop: raises Cancelled after a Ctrl-C, Stopped when the
    executor stopped this job's run. Cheap: call it once per slab or copied range."""
    if cancelled.is_set():
        raise Cancelled()
    stop = getattr(_local, "stop", None)
    if stop is not None and stop.is_set():
        raise Stopped()


def cancel() -> None:
    """What a Ctrl-C does while cleanup is pending: every thread stops at its next check()."""
    cancelled.set()


def reset() -> None:
    """Forget an earlier Ctrl-C and commit (tests that run several commands in one process)."""
    cancelled.clear()
    committed.clear()


def cleanup_pending() -> bool:
    """Whether something is open that must be removed before the process may end."""
    return _open[0] > 0


@contextmanager
def needs_cleanup() -> Iterator[None]:
    """While the block runs, Ctrl-C stops the run at a check point instead of ending the process."""
    with _open_lock:
        _open[0] += 1
    try:
        yield
    finally:
        with _open_lock:
            _open[0] -= 1


def guard_output(cls: type) -> type:
    """Class decorator for outputs (context managers that create a temporary and commit it):
    Ctrl-C waits for check points while one is open, and a `with` block that ends without an
    error after a Ctrl-C is exited as if it had raised Cancelled, so it is abandoned, not
    committed. Counting nests, so a subclass may be decorated too."""
    enter, leave = cls.__enter__, cls.__exit__

    @functools.wraps(enter)
    def __enter__(self: Any) -> Any:
        with _open_lock:
            _open[0] += 1
        try:
            return enter(self)
        except BaseException:
            with _open_lock:
                _open[0] -= 1
            raise

    @functools.wraps(leave)
    def __exit__(self: Any, exc_type: Any, exc: Any, tb: Any) -> Any:
        try:
            if exc_type is None and cancelled.is_set():
                stop = Cancelled()
                leave(self, Cancelled, stop, None)  # abandon: removes the temporary and the lock
                raise stop
            result = leave(self, exc_type, exc, tb)
            if exc_type is None:
                # the output is in place, complete: a Ctrl-C from here on (or one that came during
                # the commit itself) cannot undo it, so the command ends as the success it is
                committed.set()
                cancelled.clear()
            return result
        finally:
            with _open_lock:
                _open[0] -= 1

    cls.__enter__, cls.__exit__ = __enter__, __exit__  # type: ignore[method-assign]
    return cls


def stoppable(stop: threading.Event, job: Callable[[], T]) -> Callable[[], T]:
    """`job` for a worker thread: its check() calls also honour `stop` (set by the executor
    when another job of the run failed or the run is unwinding)."""

    def run() -> T:
        _local.stop = stop
        try:
            check()
            return job()
        finally:
            _local.stop = None

    return run


def is_interrupt(exc: BaseException | None) -> bool:
    """Whether `exc` is, or was raised while unwinding from, a KeyboardInterrupt (an error
    raised by cleanup during an interrupt is still the interrupt)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return True
        todo += [e.__context__, e.__cause__]
    return False
