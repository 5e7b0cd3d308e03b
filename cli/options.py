"""The options several commands share, as decorators (quiet, links, tp rules, pipeline partitions,
memory budget, workers, overwrite, --nproc, --step), their help texts, and `grouped`, which hands
a command its options gathered in dataclasses."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import click

from ckptkit import knobs
from ckptkit.errors import CkptkitError

from .context import FOLLOW_LINKS_KEY, Context, follow_links
from .terminal import echo


def quiet_option(fn: Callable) -> Callable:
    """-q/--quiet after the command name too (`ckptkit verify -q SRC`), as before it."""

    def remember(click_ctx: click.Context, _param: Any, value: bool) -> None:
        if value:
            obj = click_ctx.find_object(Context)
            if obj is not None:
                obj.quiet = True

    return click.option(
        "--quiet",
        "-q",
        is_flag=True,
        expose_value=False,
        callback=remember,
        is_eager=True,
        help="Print nothing but errors (no progress either); same as before the command.",
    )(fn)


def follow_links_option(fn: Callable) -> Callable:
    """--follow-links: links inside SRC that lead outside it are read (by default they are refused)."""

    def remember(click_ctx: click.Context, _param: Any, value: bool) -> None:
        if value:
            click_ctx.meta[FOLLOW_LINKS_KEY] = True

    return click.option(
        "--follow-links",
        is_flag=True,
        expose_value=False,
        callback=remember,
        help="Read files of SRC whose links lead outside it (refused by default; also "
        "CKPTKIT_FOLLOW_LINKS=1). FIFOs, devices and sockets are refused anyway.",
    )(fn)


def tp_rules_option(fn: Callable) -> Callable:
    """--tp-rules FILE: split rules for tensor-parallel DeepSpeed checkpoints (docs/tp_rules.md),
    checked when given and applied by the DeepSpeed reader for the rest of this command."""

    def remember(_click_ctx: click.Context, param: Any, value: str | None) -> None:
        from ckptkit.convert.tp_rules import use_rules_file

        try:
            use_rules_file(value)
        except CkptkitError as exc:  # one sentence, as any bad input (not click's usage form)
            echo(f"error: {exc}" if "--tp-rules" in str(exc) else f"error: --tp-rules: {exc}", err=True)
            _click_ctx.exit(exc.exit_code)
        _click_ctx.call_on_close(lambda: use_rules_file(None))  # this command's only: not the next call's

    return click.option(
        "--tp-rules",
        default=None,
        metavar="FILE",
        expose_value=False,
        callback=remember,
        help="Split rules (JSON or TOML) for tensor-parallel DeepSpeed checkpoints: which "
        "dimension each parameter's tp slices split, before the built-in Megatron "
        "and HF rules (see docs/tp_rules.md).",
    )(fn)


def partition_method_option(fn: Callable) -> Callable:
    """--partition-method (and --layer-types): how the target PipelineModule splits its layers into
    stages (a DeepSpeed pipeline checkpoint does not record it), for the rest of this command."""

    def remember(_click_ctx: click.Context, param: Any, value: str | None) -> None:
        from ckptkit.errors import UsageError
        from ckptkit.formats.deepspeed.pipeline_partition import use_partition_method

        try:
            use_partition_method(value)
        except UsageError as exc:  # before the command's own error handling: click's one-line usage error
            raise click.UsageError(str(exc)) from None
        _click_ctx.call_on_close(lambda: use_partition_method(None))  # this command's only: not the next call's

    def remember_types(_click_ctx: click.Context, param: Any, value: str | None) -> None:
        from ckptkit.errors import UsageError
        from ckptkit.formats.deepspeed.pipeline_partition import use_layer_types

        try:
            use_layer_types(value)
        except UsageError as exc:  # before the command's own error handling: click's one-line usage error
            raise click.UsageError(str(exc)) from None
        _click_ctx.call_on_close(lambda: use_layer_types(None))  # this command's only: not the next call's

    fn = click.option(
        "--layer-types",
        default=None,
        metavar="NAME,NAME*K,...",
        expose_value=False,
        callback=remember_types,
        help="DeepSpeed pipelines: the PipelineModule's layers' class (or function) names in order, "
        "as DeepSpeed logs them at start-up (NAME*K: K in a row); needed by "
        "--partition-method type:REGEX, and fixes the layer count for the others.",
    )(fn)
    return click.option(
        "--partition-method",
        default=None,
        metavar="parameters|uniform|type:REGEX",
        expose_value=False,
        callback=remember,
        help="DeepSpeed pipelines (--to pp=P,dp=W): the PipelineModule's partition_method, "
        "which decides each new stage's layers (default: parameters, DeepSpeed's "
        "default; type:REGEX needs --layer-types).",
    )(fn)


def autotp_options(fn: Callable) -> Callable:
    """--kv-heads and --tp-grain-size: the model values DeepSpeed's AutoTP cuts by, for a tp
    target written of a checkpoint AutoTP wrote (else config.json beside it, the saved config)."""

    def remember(click_ctx: click.Context, param: Any, value: int | None) -> None:
        from ckptkit.formats.deepspeed.autotp_cut import use_autotp_values

        chosen = click_ctx.meta.setdefault("ckptkit.autotp_values", {})
        chosen[param.name] = value
        use_autotp_values(chosen.get("kv_heads"), chosen.get("tp_grain_size"))
        click_ctx.call_on_close(lambda: use_autotp_values(None, None))  # this command's only

    fn = click.option(
        "--tp-grain-size",
        "tp_grain_size",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        expose_value=False,
        callback=remember,
        help="DeepSpeed AutoTP: the tp_grain_size the loading job uses (default: the saved "
        "config's tensor_parallel.tp.tp_grain_size, else 1).",
    )(fn)
    return click.option(
        "--kv-heads",
        "kv_heads",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        expose_value=False,
        callback=remember,
        help="DeepSpeed AutoTP: the model's key/value head count, by which AutoTP cuts attention "
        "projections (default: config.json in the checkpoint's folder).",
    )(fn)


def memory_budget_option(fn: Callable) -> Callable:
    return click.option(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help=f"Peak tensor bytes in flight, e.g. 256MB, 2GiB (default "
        f"{knobs.DEFAULT_MEMORY_BUDGET >> 20}MiB, or {knobs.MEMORY_BUDGET_ENV} in bytes).",
    )(fn)


def read_options(fn: Callable) -> Callable:
    fn = quiet_option(fn)
    fn = follow_links_option(fn)
    fn = tp_rules_option(fn)
    fn = memory_budget_option(fn)
    fn = click.option(
        "--workers",
        type=click.IntRange(1, 64),
        default=None,
        help=f"IO threads (default {knobs.DEFAULT_WORKERS}, or {knobs.WORKERS_ENV}).",
    )(fn)
    return fn


def run_options(fn: Callable) -> Callable:
    fn = read_options(fn)
    fn = click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")(fn)
    fn = click.option(
        "--nproc",
        type=click.IntRange(1, 256),
        default=None,
        metavar="P",
        help="Split the work over P local processes (runs itself under torchrun).",
    )(fn)
    return fn


def grouped(**groups: type) -> Callable:
    """Gather click's keyword arguments into option dataclasses: `name=Cls` hands the command
    Cls(<its fields>) as `name` (the click options themselves stay as they are)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for name, cls in groups.items():
                fields = [f.name for f in dataclasses.fields(cls) if f.name in kwargs]
                kwargs[name] = cls(**{f: kwargs.pop(f) for f in fields})
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def dtype_help() -> str:
    """--dtype's help, listing every spelling it accepts (index/dtypes.DTYPE_SPELLINGS) and no other."""
    from ckptkit.index.dtypes import DTYPE_SPELLINGS

    by_dtype: dict[str, list[str]] = {}
    for spelling, name in DTYPE_SPELLINGS.items():
        by_dtype.setdefault(name, []).append(spelling)
    return (
        "Cast floating model tensors to one of: "
        + "; ".join(", ".join(s) for s in by_dtype.values())
        + " (case-insensitive). Any other value, or an empty one, is refused."
    )


def examples(*lines: str) -> str:
    """A command's help epilog: 1-3 runnable examples, shown verbatim (tests/test_docs.py runs them
    against fixtures it links under the names EXAMPLE_NAMES describes)."""
    return "\b\nExamples:\n" + "\n".join(f"  $ {line}" for line in lines)


# The names the help examples use for their inputs (tests/test_docs.py links fixtures under them).
EXAMPLE_NAMES = (
    "Examples use dcp_ckpt and dcp_ckpt_w3 (DCP folders saved by FSDP2 at 2 and 3 ranks), "
    "ds_ckpt (a DeepSpeed save folder), state_dict.pt (a torch.save file) and ds_config.json "
    "(a DeepSpeed config)."
)


TAG_HELP = (
    "DeepSpeed: read this tag instead of the one `latest` names. Run folders: read the checkpoint of "
    "this name (e.g. checkpoint-2) instead of the newest complete one."
)


def step_option(fn: Callable) -> Callable:
    """--step N: in a run folder, the checkpoint of step N (checkpoint-N, step_N, global_stepN,
    epoch=..-step=N), passed on as --tag with that entry's name."""

    @functools.wraps(fn)
    def wrapper(*args: Any, step: int | None = None, **kwargs: Any) -> Any:
        if step is not None:
            from ckptkit.errors import UsageError
            from ckptkit.formats.registry import tag_for_step
            from ckptkit.storage.source import open_source

            if kwargs.get("tag") is not None:
                raise UsageError("--step and --tag both pick a checkpoint: give one of them")
            src = kwargs["src"]
            kwargs["tag"] = tag_for_step(src, open_source(src, follow_links()), step)
        return fn(*args, **kwargs)

    return click.option(
        "--step",
        type=click.IntRange(0),
        default=None,
        metavar="N",
        help="Run folders: read the checkpoint of step N instead of the newest complete one "
        "(DeepSpeed: tag global_stepN; Megatron: iter_000000N).",
    )(wrapper)
