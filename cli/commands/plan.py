"""`ckptkit plan SRC`: print the read plan of consolidating every tensor, without reading a byte.

Each tensor's plan (runner/plan.py) is computed and validated as consolidate's reads would be:
per tensor its spans (file, offset, length, encoding, the box they fill), then totals (spans,
bytes read per file, spans per encoding). `--to N` plans the boxes each rank of FSDP2 at N ranks
would read instead of whole tensors.
"""

from __future__ import annotations

import fnmatch
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import click

from ckptkit.index.parallel_spec import MAX_RANKS
from ckptkit.index.types import Box
from ckptkit.runner.plan import ReadPlan, ReadSpan
from ckptkit.text import escape

from ..context import Context, follow_links
from ..failure import handle_errors
from ..options import TAG_HELP, examples, follow_links_option, quiet_option, step_option, tp_rules_option


def options(tag_help: str) -> Callable[[Callable], Callable]:
    """The command's own argument and options (`plan` below adds the shared ones and the error handling)."""

    def decorate(fn: Callable) -> Callable:
        for option in reversed(
            [
                click.argument("src"),
                click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON."),
                click.option(
                    "--tensor",
                    "globs",
                    multiple=True,
                    metavar="GLOB",
                    help="Plan only tensors whose name matches GLOB (repeatable).",
                ),
                click.option(
                    "--to",
                    "to",
                    type=click.IntRange(1, MAX_RANKS),
                    default=None,
                    metavar="N",
                    help="Plan the boxes each rank of FSDP2 at N ranks reads, instead of whole tensors.",
                ),
                click.option("--tag", default=None, help=tag_help),
            ]
        ):
            fn = option(fn)
        return fn

    return decorate


def run(
    src: str, *, as_json: bool, globs: tuple[str, ...], to: int | None, tag: str | None, follow_links: bool | None
) -> None:
    """Plan every tensor of `src` (those matching `globs`; per rank of FSDP2 at `to` ranks) and print it."""
    from ckptkit.errors import UsageError
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.index.layouts import fsdp2_layout
    from ckptkit.runner.plan import Planner

    opened = open_checkpoint(src, tag=tag, follow_links=follow_links)
    index = opened.index
    keys = [k for k in index.tensors if not globs or any(fnmatch.fnmatchcase(k, g) for g in globs)]
    if not keys:
        raise UsageError(f"{src}: no tensor matches --tensor {' '.join(globs)}")
    planner = Planner(index, label=opened.source.label, file_sizes=index.files)
    layout = fsdp2_layout(index, to) if to is not None else None
    plans: list[tuple[int | None, ReadPlan]] = []
    for key in keys:
        entry = index.tensors[key]
        boxes = (
            [(a.rank, a.box) for a in layout.tensors[key]] if layout is not None else [(None, Box.whole(entry.shape))]
        )
        plans += [(rank, planner(entry, box)) for rank, box in boxes]
    totals = _totals([p for _, p in plans])
    if as_json:  # only ints and strings: plain json is strict JSON
        click.echo(
            json.dumps(
                {
                    "source": src,
                    "format": index.format,
                    "world_size": to,
                    "plans": [dict(_plan_json(p), **({"rank": r} if r is not None else {})) for r, p in plans],
                    "totals": totals,
                },
                indent=1,
            )
        )
        return
    what = f"the reads of FSDP2 at {to} ranks" if to is not None else "the reads of consolidating"
    lines = [f"{what} {len(keys)} tensor(s) of {index.format} checkpoint {src}"]
    for rank, p in plans:
        lines.append(
            f"{p.key} {p.dtype} {list(index.tensors[p.key].shape)}"
            + (f" rank {rank}" if rank is not None else "")
            + f" box {_box(p.box)}: {len(p.spans)} span(s)"
        )
        lines += _span_lines(p, "  ")
    lines.append(f"totals: {totals['spans']} span(s); " + ", ".join(f"{e} {n}" for e, n in totals["encodings"].items()))
    lines += [f"  {f}: {n} bytes" for f, n in totals["bytes_per_file"].items()]
    click.echo("\n".join(escape(line) for line in lines))  # names from the checkpoint, escaped as everywhere


def _box(box: Box) -> str:
    return f"{list(box.offsets)}+{list(box.sizes)}"


def _span_lines(p: ReadPlan, indent: str) -> list[str]:
    lines = []
    for s in p.spans:
        where = f"{s.file} offset {s.offset} length {s.length}" if s.file else f"length {s.length}"
        lines.append(f"{indent}{s.encoding} {where} -> {_box(s.box)}")
        for ref in s.refs:
            lines.append(f"{indent}  {ref.key} box {_box(ref.box)}:")
            lines += _span_lines(ref, indent + "    ")
    return lines


def _span_json(s: ReadSpan) -> dict[str, Any]:
    out: dict[str, Any] = {
        "file": s.file,
        "offset": s.offset,
        "length": s.length,
        "encoding": str(s.encoding),
        "box": {"offsets": list(s.box.offsets), "sizes": list(s.box.sizes)},
    }
    if s.refs:
        out["refs"] = [_plan_json(r) for r in s.refs]
    return out


def _plan_json(p: ReadPlan) -> dict[str, Any]:
    return {
        "key": p.key,
        "dtype": p.dtype,
        "box": {"offsets": list(p.box.offsets), "sizes": list(p.box.sizes)},
        "spans": [_span_json(s) for s in p.spans],
    }


def _totals(plans: list[ReadPlan]) -> dict[str, Any]:
    """Spans, bytes read per file (an item read for several spans counts once per plan) and spans
    per encoding, over all plans."""
    files: Counter[str] = Counter()
    encodings: Counter[str] = Counter()
    spans = 0
    for p in plans:
        files.update(p.bytes_per_file())
        encodings.update(p.encodings())
        spans += sum(1 for _ in p.walk())
    return {"spans": spans, "bytes_per_file": dict(sorted(files.items())), "encodings": dict(sorted(encodings.items()))}


@click.command(
    short_help="Print what consolidating SRC would read (no tensor data read).",
    epilog=examples(
        "ckptkit plan dcp_ckpt", "ckptkit plan --json --tensor 'model.*' ds_ckpt", "ckptkit plan --to 4 dcp_ckpt"
    ),
)
@options(TAG_HELP)
@quiet_option
@follow_links_option
@tp_rules_option
@click.pass_obj
@handle_errors
@step_option
def plan(ctx: Context, src: str, as_json: bool, globs: tuple[str, ...], to: int | None, tag: str | None) -> None:
    """Print, for every tensor of SRC, the byte spans consolidate reads (file, offset, length,
    encoding, the box each fills), then the totals. Reads the index only."""
    run(src, as_json=as_json, globs=globs, to=to, tag=tag, follow_links=follow_links())
