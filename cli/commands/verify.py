"""`ckptkit verify SRC`: every piece present, in bounds and covering its tensor (--deep: every byte)."""

from __future__ import annotations

import sys

import click

from ..context import Context, RunFlags
from ..failure import EXIT_PROBLEMS, handle_errors
from ..json_output import echo_json
from ..options import TAG_HELP, examples, grouped, read_options, step_option
from ..terminal import echo


@click.command(
    short_help="Check every piece is present and in bounds (--deep: bytes).",
    epilog=examples("ckptkit verify dcp_ckpt", "ckptkit verify --deep ds_ckpt", "ckptkit verify -q state_dict.pt"),
)
@click.argument("src")
@click.option("--deep", is_flag=True, help="Also read every byte and check the CRCs the files carry.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print {ok, summary, problems: [{file, key, kind, message}]} as JSON on stdout.",
)
@click.option("--tag", default=None, help=TAG_HELP)
@read_options
@click.pass_obj
@handle_errors
@step_option
@grouped(flags=RunFlags)
def verify(ctx: Context, src: str, deep: bool, as_json: bool, tag: str | None, flags: RunFlags) -> None:
    """Check that every piece of SRC is present, in bounds and covers its tensor exactly."""
    from ckptkit.ops.verify import check

    report = check(src, deep=deep, tag=tag, ctx=ctx.make_run_context(flags))
    if as_json:
        echo_json(report.as_json())
        sys.exit(0 if report.ok else EXIT_PROBLEMS)
    trainer_lines = []
    if report.opened is not None and report.opened.trainer is not None:
        from ckptkit.ops.trainer_folder import verify_lines

        trainer_lines = verify_lines(report.opened.trainer, list(report.opened.index.files))
    if report.problems:
        echo(
            f"{src}: {len(report.problems)} problem(s) found",
            *(f"  - {p.kind}: {p.message}" for p in report.problems),
            *trainer_lines,
            err=True,
        )
        sys.exit(EXIT_PROBLEMS)
    index = report.opened.index
    if deep:
        crcs = len(index.checks)
        what = f"every byte read, {crcs} CRC32s match" if crcs else "every byte read (the format carries no CRCs)"
    else:
        what = "structure sound"
    ctx.say(
        f"ok: {src} ({index.format}, {len(index.tensors)} tensors, {len(index.objects)} objects; {what})",
        *trainer_lines,
    )
    if deep:
        ctx.say_done()
