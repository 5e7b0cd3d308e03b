"""Where a `ckptkit` process starts (console script and `python -m ckptkit`): Ctrl-C is taken over
first (cli/sigint.py), before click, torch or any command is imported, then the command line runs."""

from __future__ import annotations

import gc

from .sigint import install


# A command indexes up to millions of small objects (a DCP checkpoint of 100k tensors), none in a
# cycle worth finding: at Python's default threshold (700 new containers) the collector runs tens
# of thousands of times and takes a fifth of the CPU (issue 17). One process, one command: rarer
# collections cost a little memory at most.
GC_THRESHOLD = (100_000, 50, 100)


def main() -> None:
    install()
    gc.set_threshold(*GC_THRESHOLD)
    from .main import main as run

    try:
        run()
    finally:
        # the interpreter's exit runs one full collection over everything still alive (the
        # command's index: ~0.35-0.7 s CPU for a ZeRO-3 checkpoint of 20k params) to free what
        # the exit frees anyway; frozen objects are out of its sight (the outputs are already
        # committed and closed: nothing waits on a finalizer in a cycle)
        gc.freeze()
