"""`ckptkit reshard SRC OUT`: a DCP or DeepSpeed checkpoint rewritten for a new world size or mesh."""

from __future__ import annotations

import click

from ..context import Context, RunFlags, relaunch_if_asked
from ..failure import handle_errors
from ..options import TAG_HELP, autotp_options, examples, grouped, partition_method_option, run_options, step_option


@click.command(
    short_help="Rewrite a DCP or DeepSpeed checkpoint for a new world size.",
    epilog=examples(
        "ckptkit reshard dcp_ckpt dcp_w4 --world-size 4",
        "ckptkit reshard ds_ckpt ds_w3 --to 3 --from 2",
        "ckptkit reshard dcp_ckpt dcp_hsdp --to mesh=dp_replicate:2,dp_shard:2",
    ),
)
@click.argument("src")
@click.argument("out")
@click.option("--world-size", "world_size", type=int, default=None, metavar="M", help="Target world size.")
@click.option(
    "--to",
    "to",
    default=None,
    metavar="M|mesh=DIM:N,...|tp=T,pp=P,...",
    help="Target world size M, or a device mesh for DCP: mesh=dp_shard:4,tp:2 (dims dp_replicate, dp_shard, tp), "
    "or parallel sizes for DeepSpeed and Megatron-Core: tp=2,pp=2,dp=2.",
)
@click.option(
    "--from",
    "from_",
    default=None,
    metavar="N|mesh=DIM:N,...",
    help="Expected source world size (checked), or the source's device mesh (else inferred).",
)
@click.option("--tag", default=None, help=TAG_HELP)
@click.option(
    "--model-only",
    is_flag=True,
    help="Leave the optimizer out (a Megatron-Core checkpoint at new parallel sizes).",
)
@partition_method_option
@autotp_options
@run_options
@click.pass_obj
@handle_errors
@step_option
@grouped(flags=RunFlags)
def reshard(
    ctx: Context,
    src: str,
    out: str,
    world_size: int | None,
    to: str | None,
    from_: str | None,
    tag: str | None,
    model_only: bool,
    flags: RunFlags,
) -> None:
    """Rewrite SRC for world size M (--world-size M, or --to M) in folder OUT, in SRC's format;
    a DCP folder also for a device mesh (--to mesh=dp_shard:4,tp:2), chunk for chunk as dcp.save."""
    from ckptkit.errors import UsageError
    from ckptkit.index.parallel_spec import parse_parallel

    parsed = parse_parallel(to, "--to") if to is not None else None
    if world_size is not None and parsed is not None and world_size != parsed:
        raise UsageError(f"--world-size {world_size} and --to {to} disagree: give the target world size once")
    target = world_size if world_size is not None else parsed
    if target is None:
        raise UsageError("reshard needs the target world size: --world-size M (or --to M)")
    source = parse_parallel(from_, "--from") if from_ is not None else None
    relaunch_if_asked(flags.nproc, out)
    from ckptkit.ops.inspect import human_bytes
    from ckptkit.ops.reshard import reshard as run_reshard

    res = run_reshard(
        src, out, target, expect_from=source, tag=tag, ctx=ctx.make_run_context(flags), model_only=model_only
    )
    ctx.say(
        f"resharded {res.format} from {res.from_world_size} to {res.to_world_size} rank(s): "
        f"{res.tensors} tensors ({human_bytes(res.bytes)}) into {out} ({len(res.files)} files)"
    )
    if res.notes:
        ctx.say(*res.notes)
    ctx.say_done()
