"""The `ckptkit` command line: inspect, verify, consolidate, reshard, convert, diff, demo, plan.

Every command takes a path and finds the format itself. A CkptkitError becomes one line on
stderr and a non-zero exit; a traceback appears only with --debug (failure.py). Everything printed
for people goes through `echo`, which escapes control characters (terminal.py): names read from a
checkpoint cannot forge lines or drive the terminal. --json output is JSON, escaped by json
(json_output.py). Ctrl-C: see sigint.py; a command that was interrupted says "interrupted" and
exits 130. This module is the application: the group, its own options, and `main`; the shared
options are in options.py, each command in commands/.
"""

from __future__ import annotations

import signal
import sys
import warnings
from typing import Any

import click

from ckptkit import interrupts, knobs
from ckptkit.errors import CkptkitError

from . import sigint
from .commands import ALL as COMMANDS
from .context import Context
from .failure import EXIT_INTERRUPTED, fail, interrupted
from .options import EXAMPLE_NAMES
from .terminal import EscapingStream, echo, show_warning


class Group(click.Group):
    """click's group, with its own messages (usage errors quote the command line) escaped too."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as exc:
            exc.show(file=EscapingStream(sys.stderr))
            sys.exit(exc.exit_code)
        except click.Abort as exc:
            if interrupts.is_interrupt(exc):
                interrupted()
            echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(
    cls=Group,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=EXAMPLE_NAMES + " Run `ckptkit COMMAND --help` for a command's options and examples.",
)
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors (also after the command name).")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option(package_name="ckptkit")
@click.pass_context
def cli(click_ctx: click.Context, quiet: bool, debug: bool) -> None:
    """Read, verify, consolidate, reshard, convert and compare sharded training checkpoints
    (torch.distributed.checkpoint / FSDP, DeepSpeed ZeRO 1-3, torch.save files, safetensors)."""
    click_ctx.obj = Context(quiet, debug)
    try:
        knobs.check_environment()  # a bad CKPTKIT_* variable: one sentence before any work
    except CkptkitError as exc:
        fail(exc, debug)
    from ckptkit.formats import run_folder

    obj = click_ctx.obj  # which checkpoint of a run folder was read: one line on stderr (not with --quiet)
    run_folder.set_listener(lambda note: None if obj.quiet else echo(note, err=True))


for command in COMMANDS:
    cli.add_command(command)


def main() -> None:
    sigint.install()  # already done by entry.main; here for callers of main() itself
    warnings.showwarning = show_warning
    from ckptkit.runner.memory import pin_mmap_threshold

    pin_mmap_threshold()
    try:
        cli(prog_name="ckptkit")
    except SystemExit as done:
        from ckptkit.runner.distributed import current, finish

        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if current().distributed:  # leave the job without tearing gloo down under its threads
            finish(current(), code)
        if code == EXIT_INTERRUPTED:  # cleanup is done: leave now, without waiting on interpreter teardown
            sigint.exit_now()
        # the command is over: a Ctrl-C while the interpreter shuts down (it restores the default
        # handler, which would kill the process) must not turn its result into "killed by SIGINT"
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise


if __name__ == "__main__":
    main()
