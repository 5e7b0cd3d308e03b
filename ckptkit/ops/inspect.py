"""`ckptkit inspect`: what a checkpoint holds, from its index alone (no payload is read)."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from math import prod
from typing import Any, Iterator

from ..formats import lightning
from ..formats.registry import Opened, open_checkpoint
from . import inspect_steps
from .inspect_steps import StepsReport
from ..index.dtypes import itemsize
from ..index.serialize import safe_value, to_json
from ..index.types import TensorEntry
from ..runner.heap import frozen_heap
from ..text import escape
from ..convert.keys import guess_step, split_roles


@dataclass
class Report:
    path: str
    format: str
    world_size: int | None
    step: int | None
    tensor_count: int
    tensor_bytes: int
    dtypes: dict[str, int]
    roles: dict[str, int]
    objects: dict[str, Any] = field(default_factory=dict)
    files: int = 0
    file_bytes: int = 0
    notes: list[str] = field(default_factory=list)  # one sentence each: what the roles and names mean
    parallel: dict[str, int] | None = None  # model-parallel sizes (tp, pp, ep, dp), when known


def inspect(
    path: str, tag: str | None = None, follow_links: bool | None = None
) -> tuple[Opened | None, Report | StepsReport]:
    """The report on `path`; a Checkpointer directory (folders `step_<N>`) is listed step by step."""
    if tag is None and inspect_steps.is_checkpointer_dir(path):
        return None, inspect_steps.describe(path)
    opened = open_checkpoint(path, tag=tag, follow_links=follow_links)
    # the index out of the collector's sight while it is summed up (runner/heap): the first full
    # collection after the read would traverse all of it (~0.3 s at 60k tensors) and free nothing
    with frozen_heap():
        index = opened.index
        if index.step is None or lightning.is_lightning(index):  # Lightning's global_step over DeepSpeed's count
            step = guess_step(index)
            index.step = step if step is not None else index.step
        split = split_roles(index)
        entries = list(index.tensors.values())
        sizes = _sizes(entries)
        dtypes = Counter()
        for t, nbytes in zip(entries, sizes):
            dtypes[t.dtype] += nbytes
        report = Report(
            path=path,
            format=index.format,
            world_size=index.world_size,
            step=index.step,
            tensor_count=len(index.tensors),
            tensor_bytes=sum(sizes),
            dtypes=dict(dtypes.most_common()),
            roles={
                "model": len(split.model),
                "optimizer": len(split.optim),
                "other": len(split.other),
                "low_precision": len(split.low_precision),
            },
            objects={k: safe_value(o.data) for k, o in index.objects.items()},
            files=len(index.files),
            file_bytes=sum(index.files.values()),
            notes=_notes(index, split),
            parallel=index.metadata.get("parallel") or None,
        )
        return opened, report


def _sizes(tensors: list[TensorEntry]) -> list[int]:
    """Each tensor's TensorEntry.nbytes, each dtype's item size looked up once: 100k tensors
    are summed, counted per dtype and ranked."""
    items: dict[str, int] = {}
    sizes: list[int] = []
    for t in tensors:
        dtype = t.dtype
        item = items.get(dtype)
        if item is None:
            item = items[dtype] = itemsize(dtype)
        sizes.append(prod(t.shape) * item)
    return sizes


def _notes(index, split) -> list[str]:
    """Lightning's layout and model prefix, optimizer state left numbered, files not read, and
    what the reader noted (index.metadata["notes"])."""
    notes = []
    info = index.metadata.get("lightning")
    if info is not None:
        prefix = info.get("model_prefix")
        notes.append(
            f"Lightning checkpoint ({info.get('layout', '?')})"
            + (
                f"; model names carry the LightningModule attribute {prefix!r}, which consolidate strips"
                if prefix
                else ""
            )
        )
    for slot in split.named_by_order:
        notes.append(
            f"optimizer state {slot}: parameter numbers named from the model's order "
            f"(one param group holding every model tensor, shapes matching)"
        )
    notes += [f"{why}: kept by number" for why in split.numbered.values()]
    notes += [f"not read: {why}" for why in index.metadata.get("unread", {}).values()]
    notes += index.metadata.get("notes", [])  # what a reader says its checkpoint holds
    return notes


def report_json(opened: Opened | None, report: Report | StepsReport) -> dict:
    if isinstance(report, StepsReport):
        return inspect_steps.to_json(report)
    with frozen_heap():  # (as in inspect: tens of thousands of new dicts, the index traversed by none)
        doc = to_json(opened.index)
    doc["summary"] = {
        "format": report.format,
        "world_size": report.world_size,
        "step": report.step,
        "tensors": report.tensor_count,
        "tensor_bytes": report.tensor_bytes,
        "dtypes": report.dtypes,
        "roles": report.roles,
        "files": report.files,
        "file_bytes": report.file_bytes,
        "notes": report.notes,
        "run_folder": _run_json(opened),
    }
    if report.parallel:  # only model-parallel checkpoints: other outputs stay as they were
        doc["summary"]["parallel"] = dict(report.parallel)
    return doc


PARALLEL_AXES = ("tp", "pp", "ep", "dp")


def parallel_sizes(parallel: dict[str, int]) -> str:
    """`tp 2 x pp 2 x dp 2`: the sizes a model-parallel checkpoint was saved with."""
    return " x ".join(f"{axis} {parallel[axis]}" for axis in PARALLEL_AXES if axis in parallel)


def split_of(attrs: dict) -> str:
    """How a tensor is split across tp, pp and ep (entry.attrs["parallel"]), e.g. `tp dim 0/2`,
    `tp fused(3) dim 0/2`, `tp replicated/2`, `pp stage 1/2`, `ep rank 3/4`; "" when not split."""
    parallel = attrs.get("parallel") or {}
    parts = []
    tp = parallel.get("tp")
    if isinstance(tp, dict):
        fused = f"fused({tp['fused']}) " if tp.get("fused") else ""
        where = "replicated" if tp.get("dim") is None else f"{fused}dim {tp.get('dim')}"
        parts.append(f"tp {where}/{tp.get('size')}")
    pp = parallel.get("pp")
    if isinstance(pp, dict):
        parts.append(f"pp stage {pp.get('stage')}/{pp.get('size')}")
    ep = parallel.get("ep")
    if isinstance(ep, dict):
        parts.append(f"ep rank {ep.get('rank')}/{ep.get('size')}")
    return ", ".join(parts)


def _run_json(opened: Opened) -> dict | None:
    """The checkpoint chosen in a run folder, and the newer ones passed over (None otherwise)."""
    run = opened.run
    if run is None:
        return None
    return {
        "folder": run.folder,
        "kind": run.kind,
        "chosen": run.entry,
        "step": run.step,
        "skipped": [{"entry": n, "why": w} for n, w in run.skipped],
    }


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return f"{n} B"


def render(opened: Opened | None, report: Report | StepsReport, max_rows: int = 40) -> list[str]:
    """A readable table: header facts, dtypes, tensors (largest first), objects. One string per
    line, names as the checkpoint has them: the printer escapes each line (ckptkit.text)."""
    if isinstance(report, StepsReport):
        return inspect_steps.render(report, human_bytes)
    with frozen_heap():  # (as in inspect: ranking the tensors would set off a full collection over the index)
        return _table(opened, report, max_rows)


def _table(opened: Opened, report: Report, max_rows: int) -> list[str]:
    lines = [
        f"checkpoint  {report.path}",
        *([f"chosen      {opened.run.entry} ({opened.run.why})"] if opened.run is not None else []),
        f"format      {report.format}",
        f"world size  {report.world_size if report.world_size is not None else '-'}",
        *([f"parallel    {parallel_sizes(report.parallel)}"] if report.parallel else []),
        f"step        {report.step if report.step is not None else '-'}",
        f"files       {report.files} ({human_bytes(report.file_bytes)})",
        f"tensors     {report.tensor_count} ({human_bytes(report.tensor_bytes)}): "
        f"{report.roles['model']} model, {report.roles['optimizer']} optimizer, {report.roles['other']} other"
        + (f", {report.roles['low_precision']} low-precision copies" if report.roles.get("low_precision") else ""),
        "dtypes      " + ", ".join(f"{d} {human_bytes(b)}" for d, b in report.dtypes.items()),
        *[f"note        {n}" for n in report.notes],
        "",
    ]
    if opened.trainer is not None:  # an HF Trainer checkpoint-N/: its parts and side files
        from .trainer_folder import describe_lines

        lines[-1:-1] = describe_lines(opened.trainer)
    entries = list(opened.index.tensors.values())
    sizes = _sizes(entries)

    def largest(i: int) -> tuple[int, str]:
        return (-sizes[i], entries[i].key)

    # the rows shown, as sorted(...)[:max_rows] gives them, without sorting 100k tensors
    tensors = (
        [entries[i] for i in heapq.nsmallest(max_rows, range(len(entries)), key=largest)]
        if max_rows >= 0
        else sorted(entries, key=lambda t: (-t.nbytes, t.key))
    )
    shown = {t.key: escape(t.key) for t in tensors[:max_rows]}  # as printed, so the columns line up
    width = min(60, max((len(k) for k in shown.values()), default=10))
    splits = {t.key: split_of(t.attrs) for t in tensors[:max_rows]}
    split_width = max((len(v) for v in splits.values()), default=0)  # 0: no split column (as before)
    split_head = "  split" if split_width else ""
    lines.append(f"{'tensor':<{width}}  {'dtype':<9} {'shape':<18} {'pieces':>6}  {'size':>10}{split_head}")
    for t in tensors[:max_rows]:
        key = shown[t.key] if len(shown[t.key]) <= width else "..." + shown[t.key][-(width - 3) :]
        alias = f"  (alias of {t.attrs['alias_of']})" if t.attrs.get("alias_of") else ""
        split = f"  {splits[t.key]:<{split_width}}" if split_width else ""
        line = (
            f"{key:<{width}}  {t.dtype:<9} {str(list(t.shape)):<18} {len(t.pieces):>6}  "
            f"{human_bytes(t.nbytes):>10}{split}{alias}"
        )
        lines.append(line.rstrip() if split_width else line)
    if len(entries) > max_rows:
        lines.append(f"... and {len(entries) - max_rows} more tensors (use --json for all)")
    if report.objects:
        lines.append("")
        lines.append("objects")
        for k, v in list(report.objects.items())[:max_rows]:
            lines.append(f"  {k} = {v[:100] if isinstance(v, str) else preview(v, 100)}")
        if len(report.objects) > max_rows:
            lines.append(f"  ... and {len(report.objects) - max_rows} more")
    return lines


def preview(value: Any, width: int) -> str:
    """repr(value)[:width] of a JSON-like value, without building the rest of it: a value may
    reference one long string thousands of times (repr would spell it out each time)."""
    out: list[str] = []
    n = 0
    for piece in _pieces(value):
        out.append(piece)
        n += len(piece)
        if n >= width:
            break
    return "".join(out)[:width]


def _pieces(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield ", " if i else ""
            yield from _pieces(k)
            yield ": "
            yield from _pieces(v)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "[" if isinstance(value, list) else "("
        for i, v in enumerate(value):
            yield ", " if i else ""
            yield from _pieces(v)
        yield "]" if isinstance(value, list) else ",)" if len(value) == 1 else ")"
    elif isinstance(value, str) and len(value) > 256:
        yield repr(value[:256])[:-1]  # (no closing quote: the preview stops before it)
    else:
        yield repr(value)
