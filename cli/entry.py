"""Where a `ckptkit` process starts (console script and `python -m ckptkit`): Ctrl-C is taken over
first (cli/sigint.py), before click, torch or any command is imported, then the command line runs."""
from __future__ import annotations

from .sigint import install


def main() -> None:
    install()
    from .main import main as run

    run()
