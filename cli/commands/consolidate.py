"""`ckptkit consolidate SRC OUT`: the model (and optionally the optimizer) as safetensors."""

from __future__ import annotations

import os

import click

from ckptkit import knobs

from ..context import Context, RunFlags, relaunch_if_asked
from ..failure import handle_errors
from ..options import TAG_HELP, dtype_help, examples, grouped, run_options, step_option


@click.command(
    short_help="Write the model as safetensors (a folder or one file).",
    epilog=examples(
        "ckptkit consolidate ds_ckpt hf_model",
        "ckptkit consolidate dcp_ckpt model.safetensors --dtype bf16",
        "ckptkit consolidate dcp_ckpt hf_opt --include-optimizer --dtype torch.float16",
    ),
)
@click.argument("src")
@click.argument("out")
@click.option("--dtype", default=None, metavar="[bf16|fp16|fp32]", help=dtype_help())
@click.option(
    "--max-shard-size",
    default=knobs.MAX_SHARD_SIZE,
    show_default=True,
    help="Largest safetensors shard, e.g. 5GB, 500MB.",
)
@click.option("--include-optimizer", is_flag=True, help="Also write optimizer state to optimizer*.safetensors.")
@click.option(
    "--config",
    "config",
    default=None,
    metavar="DIR",
    help="Copy config.json (and generation config, tokenizer files) from DIR instead of those found "
    "beside SRC, its trainer folder or its run folder.",
)
@click.option(
    "--strip-prefix", multiple=True, metavar="PREFIX", help="Drop PREFIX from names that start with it (repeatable)."
)
@click.option(
    "--rename",
    multiple=True,
    metavar="OLD=NEW",
    help="Replace the name prefix OLD by NEW (repeatable, applied in order).",
)
@click.option("--tag", default=None, help=TAG_HELP)
@run_options
@click.pass_obj
@handle_errors
@step_option
@grouped(flags=RunFlags)
def consolidate(
    ctx: Context,
    src: str,
    out: str,
    dtype: str | None,
    max_shard_size: str,
    include_optimizer: bool,
    config: str | None,
    strip_prefix: tuple[str, ...],
    rename: tuple[str, ...],
    tag: str | None,
    flags: RunFlags,
) -> None:
    """Write SRC's model as Hugging Face style safetensors: into folder OUT, or into the file OUT
    when it ends in .safetensors and the model fits in one file."""
    from ckptkit.index.dtypes import parse_dtype_option

    cast = parse_dtype_option(dtype) if dtype is not None else None  # refused before anything starts
    relaunch_if_asked(flags.nproc, out)
    from ckptkit.convert.names import KeyRules
    from ckptkit.ops.consolidate import consolidate as run_consolidate
    from ckptkit.ops.inspect import human_bytes

    run = ctx.make_run_context(flags)
    rules = KeyRules(strip=tuple(strip_prefix), renames=KeyRules.parse_renames(rename))
    res = run_consolidate(
        src,
        out,
        dtype=cast,
        max_shard_size=max_shard_size,
        include_optimizer=include_optimizer,
        tag=tag,
        rules=rules,
        config=config,
        ctx=run,
    )
    into = f"into {out}" if os.path.isfile(out) else f"into {out}: {', '.join(res.files)}"
    ctx.say(
        f"consolidated {res.model_tensors} model tensors ({human_bytes(res.model_bytes)}) "
        f"from {res.source_format} {into}"
    )
    if res.aliases:
        ctx.say("  tied tensors written once: " + ", ".join(f"{a} -> {t}" for a, t in res.aliases.items()))
    if res.optimizer_tensors:
        ctx.say(f"  optimizer: {res.optimizer_tensors} tensors")
    if res.skipped:
        shown = ", ".join(res.skipped[:5]) + (", ..." if len(res.skipped) > 5 else "")
        ctx.say(f"  not written (neither model nor optimizer): {len(res.skipped)} tensors ({shown})")
    for note in res.notes + res.side_notes + res.not_written:
        ctx.say(f"  {note}")
    ctx.say_done()
