"""Progress for people: a tqdm bar on a terminal, otherwise a plain line every few seconds (CI logs),
nothing with --quiet; and the closing line of a command, with its elapsed time and throughput.

ckptkit's library calls a Progress (ckptkit.progress); `CliProgress` backs it and keeps the count
the summary line needs. Every line goes through ckptkit.text.escape (the description may hold a
format name or a path)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from ckptkit import knobs
from ckptkit.text import escape


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (powers of 1000, as the summaries print sizes)."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return f"{n} B"


def rate_text(nbytes: float, seconds: float) -> str:
    return f"{human_bytes(nbytes / seconds)}/s" if seconds > 0 else "-"


class _Bar:
    """A tqdm bar on stderr, removed when the command ends."""

    def __init__(self) -> None:
        self._bar = None

    def start(self, total: int, desc: str) -> None:
        from tqdm import tqdm

        self.close()
        sized = _columns() > 0  # a terminal that reports no width (a bare pty) gets 80 columns
        self._bar = tqdm(
            total=total,
            desc=escape(desc),
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=sized,
            ncols=None if sized else 80,
        )

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def retotal(self, total: int) -> None:
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _Lines:
    """One plain line on stderr at most every `interval` seconds: what, bytes done of the total,
    and the rate since the start (a log file gets no carriage returns, and no flood)."""

    def __init__(self, interval: float, write: Callable[[str], None]) -> None:
        self.interval, self._write = interval, write
        self._desc, self._total, self._done = "", 0, 0
        self._t0 = self._last = time.monotonic()

    def start(self, total: int, desc: str) -> None:
        self._desc, self._total, self._done = desc, total, 0
        self._t0 = self._last = time.monotonic()

    def advance(self, n: int) -> None:
        self._done += n
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            pct = f" ({100 * self._done / self._total:.0f}%)" if self._total else ""
            self._write(
                f"{self._desc}: {human_bytes(self._done)} of {human_bytes(self._total)}{pct}, "
                f"{rate_text(self._done, now - self._t0)}"
            )

    def retotal(self, total: int) -> None:
        self._total = total

    def close(self) -> None:
        pass


class _Off:
    def start(self, total: int, desc: str) -> None:
        pass

    def retotal(self, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class CliProgress:
    """The Progress a command hands to ckptkit: shows what `mode` says ("bar", "lines" or "off"),
    counts the bytes declared and done, and times the command from its creation."""

    def __init__(self, mode: str, interval: float | None = None) -> None:
        self.mode = mode
        if mode == "bar":
            inner = _Bar()
        elif mode == "lines":
            inner = _Lines(knobs.PROGRESS_INTERVAL if interval is None else interval, _write_err)
        else:
            inner = _Off()
        self._shown = inner
        self._lock = threading.Lock()  # executors advance from worker threads
        self.t0 = time.monotonic()
        self.total = 0  # bytes declared by every start() (as retotal corrected them)
        self.done = 0
        self._phase = 0  # the total of the phase begun by the last start()

    def start(self, total: int, desc: str) -> None:
        with self._lock:
            self.total += total
            self._phase = total
            self._shown.start(total, desc)

    def retotal(self, total: int) -> None:
        """The current phase moves `total` bytes (ckptkit.progress.retotal)."""
        with self._lock:
            self.total += total - self._phase
            self._phase = total
            self._shown.retotal(total)

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            self._shown.advance(n)

    def close(self) -> None:
        with self._lock:
            self._shown.close()

    def summary(self, nbytes: int | None = None) -> str:
        """'done in 1.52 s: 4.80 GB at 3.16 GB/s': the closing line of a command that moved data."""
        elapsed = time.monotonic() - self.t0
        moved = nbytes if nbytes is not None else max(self.total, self.done)
        return f"done in {elapsed:.2f} s: {human_bytes(moved)} at {rate_text(moved, elapsed)}"


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def _write_err(line: str) -> None:
    try:
        sys.stderr.write(escape(line) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stderr must not fail the command
        pass


def make_progress(quiet: bool) -> CliProgress:
    """A bar on a terminal, plain lines otherwise, nothing with --quiet."""
    if quiet:
        return CliProgress("off")
    return CliProgress("bar" if sys.stderr.isatty() else "lines")
