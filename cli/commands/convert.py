"""`ckptkit convert SRC OUT --to BACKEND`: another backend, optimizer state included."""

from __future__ import annotations

import os
from dataclasses import dataclass

import click

from ckptkit.convert import SOURCES as CONVERT_SOURCES, TARGETS as CONVERT_TARGETS

from ..context import Context, RunFlags, relaunch_if_asked
from ..failure import handle_errors
from ..options import TAG_HELP, examples, grouped, run_options, step_option


@dataclass(frozen=True)
class ConvertTarget:
    """What convert writes: --to, --world-size, --ds-config, and the source it expects (--from)."""

    to: str
    world_size: str | None = None  # a number, or mesh=... (parsed by ops/convert.py)
    ds_config: str | None = None
    from_: str | None = None


@dataclass(frozen=True)
class NameOptions:
    """How names change on the way: --rename, --strip-prefix, --add-prefix."""

    rename: tuple[str, ...] = ()
    strip_prefix: tuple[str, ...] = ()
    add_prefix: str = ""


@dataclass(frozen=True)
class StateOptions:
    """Which state is kept, and as what: --frozen, --model-only, --drop."""

    frozen: tuple[str, ...] = ()
    model_only: bool = False
    drop: tuple[str, ...] = ()


@click.command(
    short_help="Convert to another backend, optimizer state included.",
    epilog=examples(
        "ckptkit convert ds_ckpt fsdp_w2 --to fsdp2 --world-size 2",
        "ckptkit convert dcp_ckpt model.pt --to torch --from fsdp",
        "ckptkit convert dcp_ckpt zero2_w3 --to zero2 --world-size 3 --ds-config ds_config.json",
    ),
)
@click.argument("src")
@click.argument("out")
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Choice(CONVERT_TARGETS),
    help="Target backend (fsdp/fsdp2: DCP in FSDP2's layout; hf: a safetensors folder; deepspeed: "
    "the stage the config names).",
)
@click.option(
    "--world-size",
    default=None,
    metavar="N|mesh=DIM:N,...",
    help="Ranks the target is laid out for (dcp, zero*; default: the source's), or for dcp a device "
    "mesh: mesh=dp_shard:2,tp:2 (dims dp_replicate, dp_shard, tp; tp splits as the source "
    "records them, else by --tp-rules and the built-in rules).",
)
@click.option(
    "--ds-config",
    default=None,
    metavar="CONFIG.json",
    help="The DeepSpeed config the target job loads with (needed for --to zero* from a non-ZeRO source).",
)
@click.option(
    "--from",
    "from_",
    type=click.Choice(CONVERT_SOURCES),
    default=None,
    help="Expected source format, the same names as --to (checked; it is always detected).",
)
@click.option(
    "--rename",
    multiple=True,
    metavar="OLD=NEW",
    help="Replace the name prefix OLD by NEW (repeatable, applied in order).",
)
@click.option(
    "--strip-prefix", multiple=True, metavar="PREFIX", help="Drop PREFIX from names that start with it (repeatable)."
)
@click.option("--add-prefix", default="", metavar="PREFIX", help="Prepend PREFIX to every name.")
@click.option(
    "--frozen",
    multiple=True,
    metavar="GLOB",
    help="Model tensors outside the optimizer that are frozen parameters, not buffers (repeatable glob).",
)
@click.option(
    "--model-only",
    is_flag=True,
    help="Write the model alone: the optimizer, extras and counters are dropped (and listed).",
)
@click.option(
    "--drop",
    multiple=True,
    metavar="GLOB",
    help="Leave out the canonical keys GLOB matches, e.g. 'optim.state.*.momentum_buffer' or 'extra.*' "
    "(repeatable; listed in the summary). Anything else read is written or the command stops.",
)
@click.option("--tag", default=None, help=TAG_HELP)
@run_options
@click.pass_obj
@handle_errors
@step_option
@grouped(target=ConvertTarget, names=NameOptions, keep=StateOptions, flags=RunFlags)
def convert(
    ctx: Context,
    src: str,
    out: str,
    tag: str | None,
    target: ConvertTarget,
    names: NameOptions,
    keep: StateOptions,
    flags: RunFlags,
) -> None:
    """Convert training checkpoint SRC to another backend in OUT, optimizer state included: a folder,
    or the file OUT itself for --to torch with OUT ending in .pt or .bin, and for --to safetensors/hf
    with OUT ending in .safetensors."""
    relaunch_if_asked(flags.nproc, out)
    from ckptkit.convert.names import KeyRules
    from ckptkit.ops.convert import convert as run_convert

    run = ctx.make_run_context(flags)
    rules = KeyRules(
        strip=tuple(names.strip_prefix), renames=KeyRules.parse_renames(names.rename), add=names.add_prefix
    )
    res = run_convert(
        src,
        out,
        target.to,
        world_size=target.world_size,
        ds_config=target.ds_config,
        expect_from=target.from_,
        rules=rules,
        frozen=keep.frozen,
        tag=tag,
        model_only=keep.model_only,
        drop=keep.drop,
        ctx=run,
    )
    where = f" for {res.world_size} rank(s)" if res.world_size else ""
    files = "" if os.path.isfile(out) else f" ({len(res.files)} file{'' if len(res.files) == 1 else 's'})"
    ctx.say(f"converted {res.source_format} -> {res.target}{where} into {out}{files}: {res.summary}")
    if res.notes:
        ctx.say(*res.notes)
    ctx.say_done()
