"""`ckptkit diff A B`: two checkpoints compared tensor by tensor (exit 1 when they differ)."""

from __future__ import annotations

import math
import sys
from typing import Any

import click

from ..context import Context, RunFlags
from ..failure import EXIT_PROBLEMS, fail, handle_errors
from ..json_output import echo_json
from ..options import examples, grouped, read_options
from ..terminal import echo


def _tolerance(click_ctx: click.Context, _param: Any, atol: float) -> float:
    """--atol: a difference no larger than it is close, so it is 0 or more (inf allowed); NaN or a
    negative number is no tolerance: refused in one sentence, like every bad value."""
    if math.isnan(atol) or atol < 0:
        from ckptkit.errors import UsageError

        ctx = click_ctx.find_object(Context)
        fail(UsageError(f"--atol must be a number, 0 or more (got {atol:g})"), bool(ctx and ctx.debug))
    return atol


@click.command(
    short_help="Compare two checkpoints tensor by tensor (exit 1 if unequal).",
    epilog=examples(
        "ckptkit diff --model-only --atol 1e-6 dcp_ckpt dcp_ckpt_w3", "ckptkit diff --json dcp_ckpt dcp_ckpt_w3"
    ),
)
@click.argument("a")
@click.argument("b")
@click.option(
    "--atol",
    type=float,
    default=0.0,
    show_default=True,
    callback=_tolerance,
    help="Largest absolute difference still counted as equal, 0 or more; inf counts every "
    "difference but a NaN on one side only (also allows dtype differences).",
)
@click.option("--model-only", is_flag=True, help="Compare model tensors only, not optimizer state.")
@click.option("--json", "as_json", is_flag=True, help="Print every comparison as JSON.")
@click.option(
    "--stat", is_flag=True, help="Print only the counts and the largest changes (by relative L2 change), largest first."
)
@read_options
@click.pass_obj
@handle_errors
@grouped(flags=RunFlags)
def diff(
    ctx: Context, a: str, b: str, atol: float, model_only: bool, as_json: bool, stat: bool, flags: RunFlags
) -> None:
    """Compare checkpoints A and B (any formats) tensor by tensor, with their extras and step;
    exit 0 only when equal."""
    from ckptkit.ops.diff import STAT_TOP, diff as run_diff, render

    result = run_diff(a, b, atol=atol, model_only=model_only, ctx=ctx.make_run_context(flags))
    if as_json:
        doc = {"equal": result.equal, "counts": result.counts(), "rows": [r.as_json() for r in result.rows]}
        if stat:
            doc["largest"] = [r.name for r in result.largest(STAT_TOP)]
        echo_json(doc)
    else:
        echo(*render(result, a, b, atol, stat=stat))
        ctx.say_done()
    if not result.equal:
        sys.exit(EXIT_PROBLEMS)
