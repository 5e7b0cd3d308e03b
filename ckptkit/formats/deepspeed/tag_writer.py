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
from ...runner.executor import run_jobs
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from ..torch_save.archive_writer import LazyTensor, write_archive

HELPER_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies them next to every save
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
        raise UnsupportedError("round_robin_gradients reorders ZeRO partitions by world size; resharding "
                               "such checkpoints is not supported yet")
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
    return tag or (f"global_step{index.step}" if index.step is not None else "global_step0")


def structure_bytes(value: Any) -> int:
    """Tensor bytes a file structure will hold (how a distributed run balances files)."""
    if isinstance(value, LazyTensor):
        return value.entry.nbytes
    if isinstance(value, dict):
        return sum(structure_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(structure_bytes(v) for v in value)
    return 0


def copy_file(source: Source, out: Output, rel: str, new: str) -> None:
    """A file that does not change with the sizes, streamed byte for byte."""
    size = source.size(rel)
    with out.open(new) as f:
        pos = 0
        while pos < size:
            n = min(COPY_BLOCK, size - pos)
            f.write(source.read(rel, pos, n))
            pos += n


def write_tag(out: Output, source: Source, tag: str, structures: dict[str, tuple[Any, Fetcher]], ctx: RunContext, *,
              copied: list[tuple[str, str]] = (), scripts: bool = False) -> list[str]:
    """Write `structures` (name -> (structure, the fetcher its lazy tensors read through)), copy
    `copied` (source name, output name) and, with `scripts`, the source's helper scripts, then
    `latest`; the names written."""
    copies = list(copied)
    if scripts:
        copies += [(s, s) for s in HELPER_SCRIPTS if source.exists(s) and not source.isdir(s)]
    jobs: list = [(lambda n=n, s=s, f=f: write_archive(out, n, s, f, slab_bytes=ctx.slab_bytes,
                                                       progress=ctx.progress))
                  for n, (s, f) in structures.items()]
    jobs += [(lambda a=a, b=b: copy_file(source, out, a, b)) for a, b in copies]
    weights = [structure_bytes(s) for s, _ in structures.values()] + [source.size(a) for a, _ in copies]
    run_jobs(jobs, ctx.workers, group=out.group, weights=weights)
    out.write_bytes("latest", tag.encode())
    return ["latest", *structures, *(b for _, b in copies)]
