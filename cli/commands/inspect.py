"""`ckptkit inspect SRC`: format, world size, step, tensors and values (or the index as JSON)."""

from __future__ import annotations

import click

from ckptkit import knobs

from ..context import Context, follow_links
from ..failure import handle_errors
from ..json_output import echo_json
from ..options import (
    TAG_HELP,
    examples,
    follow_links_option,
    memory_budget_option,
    quiet_option,
    step_option,
    tp_rules_option,
)
from ..terminal import echo


@click.command(
    short_help="Show format, world size, step, tensors and values.",
    epilog=examples(
        "ckptkit inspect dcp_ckpt", "ckptkit inspect --json state_dict.pt", "ckptkit inspect ds_ckpt --tag global_step2"
    ),
)
@click.argument("src")
@click.option("--json", "as_json", is_flag=True, help="Print the full index as JSON (schema ckptkit.index/1).")
@click.option("--tag", default=None, help=TAG_HELP)
@quiet_option
@follow_links_option
@tp_rules_option
@memory_budget_option
@click.pass_obj
@handle_errors
@step_option
def inspect(ctx: Context, src: str, as_json: bool, tag: str | None, memory_budget: str | None) -> None:
    """Show format, world size, step, tensors and objects of SRC."""
    from ckptkit.ops.inspect import inspect as run_inspect, render, report_json
    from ckptkit.runner import limits

    if memory_budget:  # (what unpickling and loading values whole may allocate: the same default)
        limits.set_budget(knobs.parse_size(memory_budget, "--memory-budget"))

    opened, report = run_inspect(src, tag=tag, follow_links=follow_links())
    if as_json:
        echo_json(report_json(opened, report))
    else:
        echo(*render(opened, report))
