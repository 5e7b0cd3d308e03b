"""What a command prints for people, made safe: control and invisible format characters escaped
(ckptkit.text), so names read from a checkpoint cannot forge lines or drive the terminal."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import click

from ckptkit.text import escape


def echo(*lines: str, err: bool = False) -> None:
    """Print each argument as one line, control and invisible format characters escaped
    (\\n, \\r, \\x1b, \\u202e): the one way a command prints text for people."""
    click.echo("\n".join(escape(line) for line in lines), err=err)


class EscapingStream:
    """A text stream that escapes what is written to it except line breaks (click's own
    messages, which quote the command line, and --debug tracebacks)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write("\n".join(escape(part) for part in text.split("\n")))

    def flush(self) -> None:
        self._stream.flush()


def show_warning(
    message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: str | None = None
) -> None:
    """Python's warnings (they may quote a path or a name), escaped like everything else."""
    EscapingStream(file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))
