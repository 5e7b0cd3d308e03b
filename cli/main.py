"""The `ckptkit` command line: inspect, verify, consolidate, reshard, convert, diff, demo.

Every command takes a path and finds the format itself. A CkptkitError becomes one line on
stderr and a non-zero exit; a traceback appears only with --debug. Everything printed for people
goes through `echo`, which escapes control characters (ckptkit.text): names read from a
checkpoint cannot forge lines or drive the terminal. --json output is JSON, escaped by json.
Ctrl-C: see sigint.py; a command that was interrupted says "interrupted" and exits 130.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NoReturn

import click

from ckptkit import interrupts, knobs
from ckptkit.context import RunContext
from ckptkit.convert import SOURCES as CONVERT_SOURCES, TARGETS as CONVERT_TARGETS
from ckptkit.errors import CkptkitError
from ckptkit.text import escape

from . import sigint
from .progress import CliProgress, make_progress

EXIT_PROBLEMS = 1  # verify found problems
# exit 2: a CkptkitError (its exit_code): bad input, bad options, output not writable
EXIT_INTERNAL = 3  # a bug in ckptkit
EXIT_INTERRUPTED = sigint.EXIT_INTERRUPTED  # Ctrl-C


def echo(*lines: str, err: bool = False) -> None:
    """Print each argument as one line, control and invisible format characters escaped
    (\\n, \\r, \\x1b, \\u202e): the one way a command prints text for people."""
    click.echo("\n".join(escape(line) for line in lines), err=err)


class _Escaping:
    """A text stream that escapes what is written to it except line breaks (click's own
    messages, which quote the command line, and --debug tracebacks)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write("\n".join(escape(part) for part in text.split("\n")))

    def flush(self) -> None:
        self._stream.flush()


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


def handle_errors(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context().find_object(Context)
        debug = bool(ctx and ctx.debug)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            _fail(exc, debug)
        if interrupts.cancelled.is_set():  # a Ctrl-C came too late to stop the work: still reported
            _interrupted()
        return result

    return wrapper


def _fail(exc: BaseException, debug: bool) -> NoReturn:
    """Report a command's failure the one way it is reported, and exit with its status."""
    if interrupts.cancelled.is_set() or interrupts.is_interrupt(exc):
        if debug:
            _print_traceback()
        _interrupted()  # whatever cleanup raised while unwinding from Ctrl-C is still the interrupt
    if isinstance(exc, (SystemExit, click.exceptions.Exit, click.ClickException, click.Abort)):
        raise exc  # an exit status already chosen, or click's own usage message
    if debug:
        _print_traceback()
    if isinstance(exc, CkptkitError):
        if _report(exc):
            echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    if not isinstance(exc, Exception):
        raise exc
    if _report(exc):  # a bug: say so plainly, keep the traceback for --debug
        echo(
            f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback and please report it)",
            err=True,
        )
    sys.exit(EXIT_INTERNAL)


def _interrupted() -> NoReturn:
    if sigint.should_announce():
        echo("interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)


def _print_traceback() -> None:
    traceback.print_exc(file=_Escaping(sys.stderr))


def _report(exc: BaseException) -> bool:
    """In a torchrun job: make sure every rank hears of the failure; only rank 0 prints it."""
    from ckptkit.runner.distributed import current, report_failure

    report_failure(exc)
    return current().is_root


FOLLOW_LINKS_KEY = "ckptkit.follow_links"


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


def follow_links() -> bool | None:
    """True when --follow-links was given; None leaves the choice to CKPTKIT_FOLLOW_LINKS."""
    return True if click.get_current_context().meta.get(FOLLOW_LINKS_KEY) else None


# containers this deep or deeper are written on one line each: one tensor, piece or row a line
_JSON_FLAT_DEPTH = 2
_compact_json = json.JSONEncoder(allow_nan=False, separators=(", ", ": ")).encode  # (the C encoder)


def dump_json(value: Any) -> str:
    """`value` as strict JSON (RFC 8259 has no NaN or Infinity: a non-finite number is written as
    the string "nan", "inf" or "-inf", so every parser reads it). The top levels are indented and
    each deeper value (a tensor's record, a diff row) is one line: written by the C encoder, an
    index of 100k tensors takes a fraction of a second and a tenth of the bytes that indenting
    every level in Python took (9 s, 144 MB)."""
    return "".join(_json_chunks(value, 0))


def echo_json(value: Any) -> None:
    """Print `value` as dump_json writes it, a megabyte at a time (no second copy of the text)."""
    out = click.get_text_stream("stdout")
    batch: list[str] = []
    size = 0
    for chunk in _json_chunks(value, 0):
        batch.append(chunk)
        size += len(chunk)
        if size >= 1 << 20:
            out.write("".join(batch))
            batch, size = [], 0
    batch.append("\n")
    out.write("".join(batch))
    out.flush()


def _json_chunks(value: Any, depth: int) -> Iterator[str]:
    if depth >= _JSON_FLAT_DEPTH or not isinstance(value, (dict, list, tuple)) or not value:
        try:
            yield _compact_json(value)
        except ValueError:  # a NaN or an infinity in it (or a cycle, which _finite reports as before)
            yield _compact_json(_finite(value))
        return
    pad = "\n" + " " * (depth + 1)
    if isinstance(value, dict):
        sep = "{"
        for key, item in value.items():
            yield f"{sep}{pad}{_compact_json(_json_key(key))}: "
            yield from _json_chunks(item, depth + 1)
            sep = ","
        yield "\n" + " " * depth + "}"
    else:
        sep = "["
        for item in value:
            yield sep + pad
            yield from _json_chunks(item, depth + 1)
            sep = ","
        yield "\n" + " " * depth + "]"


def _json_key(key: Any) -> str:
    """A dict key as the json module writes it (a str as it is; a number, bool or None spelled)."""
    if isinstance(key, str):
        return key
    if key is True or key is False or key is None:
        return json.dumps(key)
    if isinstance(key, float):
        return str(_finite(key)) if not math.isfinite(key) else float.__repr__(key)
    if isinstance(key, int):
        return int.__repr__(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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


def relaunch_if_asked(nproc: int | None, out: str) -> None:
    """--nproc P outside torchrun: run the same command as P local processes and exit with them."""
    if nproc and nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from .spawn import relaunch

        sys.exit(relaunch(nproc, out))


@dataclass(frozen=True)
class RunFlags:
    """--memory-budget, --workers, --overwrite and --nproc: how a command runs, not what it does."""

    memory_budget: str | None = None
    workers: int | None = None
    overwrite: bool = False
    nproc: int | None = None


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


def make_run_context(ctx: Context, flags: RunFlags) -> RunContext:
    """The one RunContext of this command: budget, workers, progress, group, links, overwrite."""
    from ckptkit.runner.distributed import from_environment

    group = from_environment()
    if not group.is_root:
        ctx.quiet = True  # rank 0 reports for the job
    ctx.progress = make_progress(ctx.quiet)
    run = RunContext(progress=ctx.progress, overwrite=flags.overwrite, group=group, follow_links=follow_links())
    if flags.memory_budget:
        run.memory_budget = knobs.parse_size(flags.memory_budget, "--memory-budget")
    if flags.workers:
        run.workers = flags.workers
    from ckptkit.runner import limits

    limits.set_budget(run.memory_budget)  # also bounds what indexing loads whole (this one command)
    return run


class _Group(click.Group):
    """click's group, with its own messages (usage errors quote the command line) escaped too."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as exc:
            exc.show(file=_Escaping(sys.stderr))
            sys.exit(exc.exit_code)
        except click.Abort as exc:
            if interrupts.is_interrupt(exc):
                _interrupted()
            echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


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


@click.group(
    cls=_Group,
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
        _fail(exc, debug)
    from ckptkit.formats import run_folder

    obj = click_ctx.obj  # which checkpoint of a run folder was read: one line on stderr (not with --quiet)
    run_folder.set_listener(lambda note: None if obj.quiet else echo(note, err=True))


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
            from ckptkit.formats.run_folder import tag_for_step
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
        "(DeepSpeed: tag global_stepN).",
    )(wrapper)


@cli.command(
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


@cli.command(
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

    report = check(src, deep=deep, tag=tag, ctx=make_run_context(ctx, flags))
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


@cli.command(
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

    run = make_run_context(ctx, flags)
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


@cli.command(
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
    metavar="M|mesh=DIM:N,...",
    help="Target world size M, or a device mesh for DCP: mesh=dp_shard:4,tp:2 (dims dp_replicate, dp_shard, tp).",
)
@click.option(
    "--from",
    "from_",
    default=None,
    metavar="N|mesh=DIM:N,...",
    help="Expected source world size (checked), or the source's device mesh (else inferred).",
)
@click.option("--tag", default=None, help=TAG_HELP)
@partition_method_option
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

    res = run_reshard(src, out, target, expect_from=source, tag=tag, ctx=make_run_context(ctx, flags))
    ctx.say(
        f"resharded {res.format} from {res.from_world_size} to {res.to_world_size} rank(s): "
        f"{res.tensors} tensors ({human_bytes(res.bytes)}) into {out} ({len(res.files)} files)"
    )
    if res.notes:
        ctx.say(*res.notes)
    ctx.say_done()


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


@cli.command(
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

    run = make_run_context(ctx, flags)
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


def _tolerance(click_ctx: click.Context, _param: Any, atol: float) -> float:
    """--atol: a difference no larger than it is close, so it is 0 or more (inf allowed); NaN or a
    negative number is no tolerance: refused in one sentence, like every bad value."""
    if math.isnan(atol) or atol < 0:
        from ckptkit.errors import UsageError

        ctx = click_ctx.find_object(Context)
        _fail(UsageError(f"--atol must be a number, 0 or more (got {atol:g})"), bool(ctx and ctx.debug))
    return atol


@cli.command(
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

    result = run_diff(a, b, atol=atol, model_only=model_only, ctx=make_run_context(ctx, flags))
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


@cli.command(
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


from . import plan_cmd  # noqa: E402


@cli.command(
    short_help="Print what consolidating SRC would read (no tensor data read).",
    epilog=examples(
        "ckptkit plan dcp_ckpt", "ckptkit plan --json --tensor 'model.*' ds_ckpt", "ckptkit plan --to 4 dcp_ckpt"
    ),
)
@plan_cmd.options(TAG_HELP)
@quiet_option
@follow_links_option
@tp_rules_option
@click.pass_obj
@handle_errors
@step_option
def plan(ctx: Context, src: str, as_json: bool, globs: tuple[str, ...], to: int | None, tag: str | None) -> None:
    """Print, for every tensor of SRC, the byte spans consolidate reads (file, offset, length,
    encoding, the box each fills), then the totals. Reads the index only."""
    plan_cmd.run(src, as_json=as_json, globs=globs, to=to, tag=tag, follow_links=follow_links())


def _show_warning(
    message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: str | None = None
) -> None:
    """Python's warnings (they may quote a path or a name), escaped like everything else."""
    _Escaping(file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def main() -> None:
    sigint.install()  # already done by entry.main; here for callers of main() itself
    warnings.showwarning = _show_warning
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
