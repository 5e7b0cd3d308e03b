"""Ctrl-C for the whole `ckptkit` process (cli/entry.py installs it first).

Ctrl-C is taken over first, before click, torch or any command is imported, and keeps one meaning
for the whole life of the process: the command stops, "interrupted" is printed once (one line on
stderr) and the exit status is 130, with nothing left behind.

- While nothing needs cleaning up (start-up, indexing, read-only commands) the process ends at
  once: there is nothing to remove, and no exception has to travel through code that cannot take
  one (torch's C++ start-up aborts the process when a KeyboardInterrupt is raised inside it).
- While an output (or the --nproc launcher's job) is open, Ctrl-C only asks the run to stop
  (ckptkit.interrupts): every thread stops at its next check point, the output removes its
  temporary folder and lock, and the command reports the interrupt.
- A second Ctrl-C during that cleanup is ignored, so the cleanup completes; a third ends the
  process at once (the next run's sweep removes what is left, and nothing left looks complete).
"""

from __future__ import annotations

import os
import signal
import sys

TYPE_CHECKING = False  # not typing's: this module imports nothing it can do without
if TYPE_CHECKING:
    from typing import Any, NoReturn

EXIT_INTERRUPTED = 130
QUIET_ENV = "CKPTKIT_QUIET_INTERRUPT"  # set by the --nproc launcher in its children: it reports for them
FORCE_AFTER = 3  # the Ctrl-C that ends the process even while cleaning up

_presses = [0]
_announced = [False]


def should_announce() -> bool:
    """True once per process, where the job's report belongs (not in a launcher's children, not
    on a rank other than 0): the caller then prints "interrupted"."""
    if _announced[0]:
        return False
    _announced[0] = True
    return not os.environ.get(QUIET_ENV) and os.environ.get("RANK", "0") == "0"


def exit_now() -> NoReturn:
    """Say "interrupted" (once) and end the process without unwinding: nothing is open."""
    try:  # a Ctrl-C pressed twice at once would otherwise run a second handler inside this one, which
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # found "interrupted" claimed and exited silently
    except ValueError:  # not the main thread: signals are the main thread's anyway
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # inside a signal handler the stream may be mid-write: skip it
            pass
    if should_announce():
        try:
            os.write(2, b"interrupted\n")
        except OSError:
            pass
    os._exit(EXIT_INTERRUPTED)


def on_sigint(signum: int, frame: Any) -> None:
    _presses[0] += 1
    interrupts = sys.modules.get("ckptkit.interrupts")  # not imported yet: nothing can be open
    if _presses[0] >= FORCE_AFTER or interrupts is None:
        exit_now()
    if interrupts.committed.is_set() or interrupts.cancelled.is_set():
        return  # the output is complete (the command ends in success), or already stopping
    if interrupts.cleanup_pending():
        interrupts.cancel()  # the run stops at its next check point and removes what it wrote
        return
    exit_now()


def install() -> None:
    """Take Ctrl-C over for this process (main thread only; call it first)."""
    signal.signal(signal.SIGINT, on_sigint)
