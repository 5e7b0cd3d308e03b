"""What every DeepSpeed writer does around its own layout, written once.

The ZeRO, tensor-parallel, pipeline and mixture-of-experts writers each decide a different layout,
then all do the same things: read the saved config's ZeRO options (and refuse the one that
reorders partitions), pick the tag, and write the tag's files: structures streamed from the
source, files that do not change with the sizes copied byte for byte, DeepSpeed's helper scripts
beside the tag, and `latest` last, so a half-written output never names a tag.
"""

from __future__ import annotations

import math
from typing import Any

from ...context import RunContext
from ...errors import UnsupportedError
from ...index.types import CheckpointIndex
from ...progress import Progress, retotal
from ...runner.executor import run_jobs
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from ..torch_save.archive_writer import SMALL_ARCHIVE, LazyTensor, small_archive_bytes, write_archive
from .names import HELPER_SCRIPTS, LATEST, step_tag

COPY_BLOCK = 8 << 20
ELEMENT_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def saved_config(index: CheckpointIndex) -> dict:
    """The DeepSpeed config the checkpoint saved (`ds_config`), or {}."""
    obj = index.objects.get("ds.ds_config")
    return obj.data if obj is not None and isinstance(obj.data, dict) else {}


def zero_config(index: CheckpointIndex) -> dict:
    """The saved config's `zero_optimization` section ({} when absent), refusing round-robin
    gradients: they reorder ZeRO partitions by world size, which no writer lays out."""
    zero_cfg = saved_config(index).get("zero_optimization", {})
    zero_cfg = zero_cfg if isinstance(zero_cfg, dict) else {}
    if zero_cfg.get("round_robin_gradients"):
        raise UnsupportedError(
            "round_robin_gradients reorders ZeRO partitions by world size; resharding "
            "such checkpoints is not supported yet"
        )
    return zero_cfg


def alignment(zero_cfg: dict, dtype: str) -> int:
    """Elements each parameter is padded to in a flat group (`parameter_alignment`: 16 bytes)."""
    return 16 // math.gcd(16, ELEMENT_SIZE.get(dtype, 4)) if zero_cfg.get("parameter_alignment") else 1


def alignment_paddings(shapes: list[tuple[int, ...]], align: int) -> list[int]:
    """DeepSpeed's per-parameter alignment padding of a flat group (none after the last)."""
    out, offset = [], 0
    for i, shape in enumerate(shapes):
        offset += math.prod(shape)
        pad = 0 if i == len(shapes) - 1 else (-offset) % align
        out.append(pad)
        offset += pad
    return out


def tag_name(tag: str | None, index: CheckpointIndex) -> str:
    """The source's tag, or DeepSpeed's default name for the step when it was given as the tag folder."""
    return tag or step_tag(index.step if index.step is not None else 0)


def structure_bytes(value: Any, seen: set[int] | None = None) -> int:
    """Tensor bytes a file structure will hold, each entry once as the archive writer stores it
    (how a distributed run balances files, and the progress total: what the writer advances)."""
    seen = set() if seen is None else seen
    if isinstance(value, LazyTensor):
        if id(value.entry) in seen:
            return 0
        seen.add(id(value.entry))
        return value.entry.nbytes
    if isinstance(value, dict):
        values = value.values()
    elif isinstance(value, (list, tuple)):
        values = value
    else:
        return 0
    total = 0
    for v in values:  # scalars (a torch.Size's ints: 20k param_shapes in a ZeRO-3 file) hold no tensor
        t = type(v)
        if t is not int and t is not str and t is not float and t is not bool and v is not None:
            total += structure_bytes(v, seen)
    return total


def copy_file(source: Source, out: Output, rel: str, new: str, progress: Progress | None = None) -> None:
    """A file that does not change with the sizes, streamed byte for byte."""
    size = source.size(rel)
    with out.open(new) as f:
        pos = 0
        while pos < size:
            n = min(COPY_BLOCK, size - pos)
            f.write(source.read(rel, pos, n))
            pos += n
            if progress is not None:
                progress.advance(n)


def _alike(structures: dict[str, tuple[Any, Fetcher]]) -> list[list[str]]:
    """The names grouped by the archive they write, in their order: top-level dicts with the same
    keys, in the same order, holding the very same objects, read through the same fetcher, pickle
    to the same bytes and read the same tensors (ZeRO-3's model-states file is the same on every
    rank but the first, and holds a placeholder tensor per parameter: 20k, on every rank)."""
    groups: dict[Any, list[str]] = {}
    for name, (structure, fetcher) in structures.items():
        key: Any = name
        if type(structure) is dict:
            key = (id(fetcher), tuple([(k, id(v)) for k, v in structure.items()]))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _write_alike(out: Output, names: list[str], structure: Any, fetcher: Fetcher, ctx: RunContext) -> None:
    """One small archive assembled once and written under each name (its tensors' bytes counted
    in the progress once per file, as writing each would)."""
    counted = _Counted(ctx.progress)
    data = small_archive_bytes(structure, fetcher, slab_bytes=ctx.slab_bytes, progress=counted)
    if data is None:  # (its tensors were too large after all: each file written as usual)
        for name in names:
            write_archive(out, name, structure, fetcher, slab_bytes=ctx.slab_bytes, progress=ctx.progress)
        return
    for i, name in enumerate(names):
        with out.open(name) as f:
            f.write(data)
        if i:
            ctx.progress.advance(counted.total)


class _Counted:
    """A progress that passes every advance on and counts it."""

    def __init__(self, inner: Progress) -> None:
        self.inner, self.total = inner, 0

    def advance(self, n: int) -> None:
        self.total += n
        self.inner.advance(n)


def write_tag(
    out: Output,
    source: Source,
    tag: str,
    structures: dict[str, tuple[Any, Fetcher]],
    ctx: RunContext,
    *,
    copied: list[tuple[str, str]] = (),
    scripts: bool = False,
) -> list[str]:
    """Write `structures` (name -> (structure, the fetcher its lazy tensors read through)), copy
    `copied` (source name, output name) and, with `scripts`, the source's helper scripts, then
    `latest`; the names written."""
    copies = list(copied)
    if scripts:
        copies += [(s, s) for s in HELPER_SCRIPTS if source.exists(s) and not source.isdir(s)]
    jobs: list = []
    weights: list[int] = []
    for names in _alike(structures):
        structure, fetcher = structures[names[0]]
        weight = structure_bytes(structure)
        if len(names) > 1 and weight <= min(SMALL_ARCHIVE, ctx.slab_bytes):
            jobs.append(lambda names=names, s=structure, f=fetcher: _write_alike(out, names, s, f, ctx))
            weights.append(weight * len(names))
            continue
        for name in names:
            s, f = structures[name]
            jobs.append(
                lambda n=name, s=s, f=f: write_archive(out, n, s, f, slab_bytes=ctx.slab_bytes, progress=ctx.progress)
            )
            weights.append(structure_bytes(s) if name != names[0] else weight)
    jobs += [(lambda a=a, b=b: copy_file(source, out, a, b, ctx.progress)) for a, b in copies]
    weights += [source.size(a) for a, _ in copies]
    # the progress total: what this process writes (each rank's partitions with padding, tensors on
    # every rank, copied files), not the source's bytes the operation started with
    group = out.group
    mine = group.assign(list(weights)) if group is not None and group.distributed else range(len(weights))
    retotal(ctx.progress, sum(weights[i] for i in mine))
    run_jobs(jobs, ctx.workers, group=out.group, weights=weights)
    out.write_bytes(LATEST, tag.encode())
    return [LATEST, *structures, *(b for _, b in copies)]
