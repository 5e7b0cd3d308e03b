"""tqdm behind ckptkit's Progress interface, shown only on a terminal and never with --quiet."""
from __future__ import annotations

import sys

from ckptkit.progress import LockedProgress, NullProgress, Progress
from ckptkit.text import escape


class TqdmProgress:
    def __init__(self) -> None:
        self._bar = None

    def start(self, total: int, desc: str) -> None:
        from tqdm import tqdm

        self.close()
        self._bar = tqdm(total=total, desc=escape(desc), unit="B", unit_scale=True, unit_divisor=1000,
                         file=sys.stderr, leave=False, dynamic_ncols=True)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def make_progress(quiet: bool) -> Progress:
    if quiet or not sys.stderr.isatty():
        return NullProgress()
    return LockedProgress(TqdmProgress())
