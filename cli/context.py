"""What one command carries through click (quiet, debug, its progress) and the one RunContext it
builds from the run flags (--memory-budget, --workers, --overwrite, --nproc, --follow-links)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import click

from ckptkit import knobs
from ckptkit.context import RunContext

from .progress import CliProgress, make_progress
from .terminal import echo

FOLLOW_LINKS_KEY = "ckptkit.follow_links"


@dataclass(frozen=True)
class RunFlags:
    """--memory-budget, --workers, --overwrite and --nproc: how a command runs, not what it does."""

    memory_budget: str | None = None
    workers: int | None = None
    overwrite: bool = False
    nproc: int | None = None


class Context:
    def __init__(self, quiet: bool, debug: bool) -> None:
        self.quiet, self.debug = quiet, debug
        self.progress: CliProgress | None = None  # set by make_run_context: shows and times the run

    def say_done(self, nbytes: int | None = None) -> None:
        """The closing line of a command that moved data: elapsed time and throughput."""
        if self.progress is not None:
            self.say(self.progress.summary(nbytes))

    def say(self, *lines: str) -> None:
        if not self.quiet:
            echo(*(lines or ("",)))

    def make_run_context(self, flags: RunFlags) -> RunContext:
        """The one RunContext of this command: budget, workers, progress, group, links, overwrite."""
        from ckptkit.runner.distributed import from_environment

        group = from_environment()
        if not group.is_root:
            self.quiet = True  # rank 0 reports for the job
        self.progress = make_progress(self.quiet)
        run = RunContext(progress=self.progress, overwrite=flags.overwrite, group=group, follow_links=follow_links())
        if flags.memory_budget:
            run.memory_budget = knobs.parse_size(flags.memory_budget, "--memory-budget")
        if flags.workers:
            run.workers = flags.workers
        from ckptkit.runner import limits

        limits.set_budget(run.memory_budget)  # also bounds what indexing loads whole (this one command)
        return run


def follow_links() -> bool | None:
    """True when --follow-links was given; None leaves the choice to CKPTKIT_FOLLOW_LINKS."""
    return True if click.get_current_context().meta.get(FOLLOW_LINKS_KEY) else None


def relaunch_if_asked(nproc: int | None, out: str) -> None:
    """--nproc P outside torchrun: run the same command as P local processes and exit with them."""
    if nproc and nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from .spawn import relaunch

        sys.exit(relaunch(nproc, out))
