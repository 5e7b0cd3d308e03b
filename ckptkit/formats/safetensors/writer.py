"""Write tensors as Hugging Face style safetensors, streaming slab by slab.

The header of every shard is computed up front (shapes and dtypes are known), so each shard
is written front to back in one pass; shards are written in parallel. Tied tensors are written
once and recorded under __metadata__["ckptkit.aliases"]; transformers ignores the extra key.
"""

from __future__ import annotations

import json
import struct
from json.encoder import encode_basestring_ascii

from ...index.dtypes import to_safetensors
from ...context import RunContext
from ...runner.executor import run_jobs
from ...runner.fetch import Fetcher
from ...runner.stream import stream_tensor
from ...storage import kernel_copy
from ...storage.commit import Output
from ..protocols import OutTensor
from .reader import ALIASES_KEY, INDEX_NAME, OBJECTS_KEY

# tensors whose plain byte ranges are copied by one kernel_copy.copy call: up to this many bytes
# or ranges, so planning and copying still take turns on a large shard
_GATHER_BYTES = 64 << 20
_GATHER_RANGES = 8192


def plan_shards(tensors: list[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    """Greedy, in order: a new shard starts when the next tensor would overflow the limit."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards if shards[0] else []


def shard_names(basename: str, count: int) -> list[str]:
    if count <= 1:
        return [f"{basename}.safetensors"]
    return [f"{basename}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def build_header(tensors: list[OutTensor], metadata: dict[str, str]) -> bytes:
    raw = _joined_header(tensors, metadata) or _dumped_header(tensors, metadata)
    data = raw.encode("utf-8")
    data += b" " * (-len(data) % 8)  # the data buffer starts 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(data)) + data


def _dumped_header(tensors: list[OutTensor], metadata: dict[str, str]) -> str:
    """The header as json.dumps writes it: what _joined_header must equal, byte for byte."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": to_safetensors(t.dtype),
            "shape": list(t.entry.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    return json.dumps(header, separators=(",", ":"))


def _joined_header(tensors: list[OutTensor], metadata: dict[str, str]) -> str | None:
    """_dumped_header's text, one string per tensor (each shape's and dtype's text made once),
    without a dict per tensor: 30k tensors are 30k entries. None where the dict's text could
    differ (no tensors, a name twice or "__metadata__", a name not a str, a shape not a tuple
    of ints): _dumped_header writes those."""
    names = [t.name for t in tensors]
    if (
        not names
        or "__metadata__" in names
        or len(set(names)) != len(names)
        or any(type(n) is not str for n in names)
        or any(type(t.entry.shape) is not tuple or any(type(d) is not int for d in t.entry.shape) for t in tensors)
    ):
        return None
    dtypes: dict[str, str] = {}
    shapes: dict[tuple[int, ...], str] = {}
    parts = [json.dumps({"__metadata__": metadata}, separators=(",", ":"))[:-1]]
    offset = 0
    for t in tensors:  # per tensor: kept lean
        dtype = dtypes.get(t.dtype)
        if dtype is None:
            dtype = dtypes[t.dtype] = encode_basestring_ascii(to_safetensors(t.dtype))
        shape = shapes.get(t.entry.shape)
        if shape is None:
            shape = shapes[t.entry.shape] = json.dumps(list(t.entry.shape), separators=(",", ":"))
        end = offset + t.nbytes
        parts.append(
            f'{encode_basestring_ascii(t.name)}:{{"dtype":{dtype},"shape":{shape},"data_offsets":[{offset},{end}]}}'
        )
        offset = end
    return ",".join(parts) + "}"


def write_safetensors(
    out: Output,
    fetcher: Fetcher,
    tensors: list[OutTensor],
    *,
    basename: str = "model",
    max_shard_bytes: int,
    ctx: RunContext,
    aliases: dict[str, str] | None = None,
    objects: dict | None = None,
    write_index: bool = True,
) -> list[str]:
    """Write `tensors` into one or more shards in `out`; returns the file names written."""
    slab_bytes, progress = ctx.slab_bytes, ctx.progress
    shards = plan_shards(tensors, max_shard_bytes) or [[]]
    names = shard_names(basename, len(shards))
    base_meta: dict[str, str] = {"format": "pt"}
    if aliases:
        base_meta[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    if objects:
        base_meta[OBJECTS_KEY] = json.dumps(objects, sort_keys=True, default=str)

    def job(name: str, shard: list[OutTensor]):
        def run() -> None:
            with out.open(name) as f:
                f.write(build_header(shard, base_meta))
                plain = kernel_copy.available(fetcher.source)
                # plain byte ranges of consecutive tensors, copied by one call (its small ranges
                # gathered into one write): 10k small tensors are not 10k flushes and writes
                gathered: list = []
                gathered_bytes = 0
                for t in shard:
                    ranges = fetcher.byte_ranges(t.entry, dtype=t.dtype) if plain else None
                    if ranges is not None:  # plain bytes: copy them in the kernel
                        gathered += ranges
                        gathered_bytes += t.nbytes
                        if gathered_bytes >= _GATHER_BYTES or len(gathered) >= _GATHER_RANGES:
                            kernel_copy.copy(fetcher.source, gathered, f, progress.advance)
                            gathered, gathered_bytes = [], 0
                        continue
                    if gathered:
                        kernel_copy.copy(fetcher.source, gathered, f, progress.advance)
                        gathered, gathered_bytes = [], 0
                    for chunk in stream_tensor(fetcher, t.entry, t.dtype, slab_bytes):
                        f.write(chunk)
                        progress.advance(len(chunk))
                if gathered:
                    kernel_copy.copy(fetcher.source, gathered, f, progress.advance)

        return run

    run_jobs(
        [job(n, s) for n, s in zip(names, shards)],
        ctx.workers,
        group=out.group,
        weights=[sum(t.nbytes for t in s) for s in shards],
    )
    if len(shards) > 1 and write_index:
        weight_map = {t.name: n for n, s in zip(names, shards) for t in s}
        doc = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
        if aliases:
            doc["metadata"]["ckptkit_aliases"] = aliases
        out.write_bytes(
            INDEX_NAME if basename == "model" else f"{basename}.safetensors.index.json",
            json.dumps(doc, indent=2, sort_keys=True).encode(),
        )
    return names
