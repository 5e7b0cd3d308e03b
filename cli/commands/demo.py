"""`ckptkit demo`: a tiny FSDP2 model trained, then inspected, resharded, consolidated and verified."""

from __future__ import annotations

import click

from ..context import Context
from ..failure import handle_errors
from ..options import examples, quiet_option
from ..terminal import echo


@click.command(
    short_help="Train a tiny FSDP2 model, then reshard and consolidate it.",
    epilog=examples("ckptkit demo --out ckptkit-demo"),
)
@click.option("--out", default="ckptkit-demo", show_default=True, help="Folder for the demo's checkpoints.")
@quiet_option
@click.pass_obj
@handle_errors
def demo(ctx: Context, out: str) -> None:
    """Train a tiny model with FSDP2 on 2 CPU processes, then inspect, reshard, consolidate, verify."""
    from ckptkit.demo.run import run_demo

    run_demo(out, say=echo if not ctx.quiet else (lambda *_lines: None))
