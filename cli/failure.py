"""How a command ends when something goes wrong: a CkptkitError is one line on stderr and its exit
status (2), a bug is one line and exit 3 (the traceback only with --debug), Ctrl-C is "interrupted"
and exit 130 (see sigint.py). In a torchrun job every rank hears of a failure; rank 0 prints it."""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Any, Callable, NoReturn

import click

from ckptkit import interrupts
from ckptkit.errors import CkptkitError

from . import sigint
from .context import Context
from .terminal import EscapingStream, echo

EXIT_PROBLEMS = 1  # verify found problems
# exit 2: a CkptkitError (its exit_code): bad input, bad options, output not writable
EXIT_INTERNAL = 3  # a bug in ckptkit
EXIT_INTERRUPTED = sigint.EXIT_INTERRUPTED  # Ctrl-C


def handle_errors(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context().find_object(Context)
        debug = bool(ctx and ctx.debug)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            fail(exc, debug)
        if interrupts.cancelled.is_set():  # a Ctrl-C came too late to stop the work: still reported
            interrupted()
        return result

    return wrapper


def fail(exc: BaseException, debug: bool) -> NoReturn:
    """Report a command's failure the one way it is reported, and exit with its status."""
    if interrupts.cancelled.is_set() or interrupts.is_interrupt(exc):
        if debug:
            _print_traceback()
        interrupted()  # whatever cleanup raised while unwinding from Ctrl-C is still the interrupt
    if isinstance(exc, (SystemExit, click.exceptions.Exit, click.ClickException, click.Abort)):
        raise exc  # an exit status already chosen, or click's own usage message
    if debug:
        _print_traceback()
    if isinstance(exc, CkptkitError):
        if _report(exc):
            echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    if not isinstance(exc, Exception):
        raise exc
    if _report(exc):  # a bug: say so plainly, keep the traceback for --debug
        echo(
            f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback and please report it)",
            err=True,
        )
    sys.exit(EXIT_INTERNAL)


def interrupted() -> NoReturn:
    if sigint.should_announce():
        echo("interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)


def _print_traceback() -> None:
    traceback.print_exc(file=EscapingStream(sys.stderr))


def _report(exc: BaseException) -> bool:
    """In a torchrun job: make sure every rank hears of the failure; only rank 0 prints it."""
    from ckptkit.runner.distributed import current, report_failure

    report_failure(exc)
    return current().is_root
