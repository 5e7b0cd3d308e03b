"""Write a DCP folder for a target layout: `.metadata` plus one `__{rank}_0.distcp` per rank.

Each rank's file holds exactly the chunks that rank owns in the layout, so on load every rank
reads only its own file. Chunks larger than a slab are split into several row-slab chunks (DCP
allows any tiling), which keeps memory bounded. Items are torch.save archives, as torch's
FileSystemWriter writes them; `.metadata` pickles torch's Metadata classes (as stand-ins, with the
state torch's own pickling gives them, so writing needs no torch) and `dcp.load` (with
resharding) reads it. Values copied from a DCP source keep their exact bytes.
"""

from __future__ import annotations

import gc
import itertools
import operator
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from ...index import geometry
from ...index.dtypes import itemsize
from ...index.layouts import Layout
from ...index.types import Box, CheckpointIndex, Encoding, FlatRange, Location, ObjectEntry, Piece, TensorEntry
from ...index.virtual import REF
from ...context import RunContext
from ...progress import Progress
from ...repickle import dumps, stand_in, stand_in_call
from ...runner.executor import run_jobs
from ...runner.fetch import Fetcher
from ...storage.commit import Output
from ...storage.source import Source
from ...torch_types import DType, Size
from ..torch_save.archive_writer import LazyTensor, small_tensor_archive, write_archive_to
from .metadata_pickle import metadata_pickle

DCP_VERSION = "1.0.0"
_METADATA = "torch.distributed.checkpoint.metadata."
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"
_PENDING_BYTES = 1 << 20  # small items' archives are gathered up to this, then written with one call
# torch.strided and _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT are single objects in torch, so
# pickle writes each once and refers back to it: one stand-in each does the same
_STRIDED = stand_in_call("torch.serialization._get_layout", "torch.strided")
_CONTIGUOUS = stand_in_call(_METADATA + "_MEM_FORMAT_ENCODING", 0)


@dataclass
class _Written:
    key: str
    box: Box | None  # None for a bytes item
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def write_dcp(
    out: Output,
    index: CheckpointIndex,
    fetcher: Fetcher,
    layout: Layout,
    *,
    ctx: RunContext,
    source: Source | None = None,
) -> list[str]:
    """Write `index`'s tensors in `layout` and its objects (on rank 0) into `out`. `source`: the DCP
    checkpoint `index` was read from, whose bytes items are copied as they are (None: re-serialised)."""
    slab_bytes, progress = ctx.slab_bytes, ctx.progress
    if fetcher.index is None or any(k not in fetcher.index.tensors for k in index.tensors):
        fetcher = Fetcher(fetcher.source, index=index)  # items are virtual tensors referring to index keys
    per_rank: dict[int, list[tuple[str, Box]]] = {r: [] for r in range(layout.world_size)}
    for key, assigns in layout.tensors.items():
        entry = index.tensors[key]
        item = itemsize(entry.dtype)
        seen: set[Box] = set()
        for a in sorted(assigns, key=lambda a: a.rank):
            if a.box in seen:  # replicated: the lowest rank writes it, the others read that copy
                continue
            seen.add(a.box)
            if a.box.numel == 0:
                per_rank[a.rank].append((key, a.box))
                continue
            if layout.exact_chunks:  # torch's chunk, whole (a mesh layout: chunks as dcp.save writes them)
                per_rank[a.rank].append((key, a.box))
                continue
            for slab in geometry.split_rowmajor(a.box, max(1, slab_bytes // item)):
                per_rank[a.rank].append((key, slab))

    def job(rank: int):
        def run() -> list[_Written]:
            written: list[_Written] = []
            name = data_file(rank)
            with out.open(name) as f:
                pending = bytearray()  # small items' archives, written together (one write per MiB)
                pos = f.tell()
                for key, box in _in_order(per_rank[rank], index, layout, rank):
                    if box is not None:
                        small = _small_item(index.tensors[key], box, fetcher, slab_bytes)
                        if small is not None:
                            pending += small
                            written.append(_Written(key, box, name, pos, len(small)))
                            pos += len(small)
                            progress.advance(box.numel * itemsize(index.tensors[key].dtype))
                            if len(pending) >= _PENDING_BYTES:
                                f.write(pending)
                                pending.clear()
                            continue
                    if pending:
                        f.write(pending)
                        pending.clear()
                    start = f.tell()
                    if box is None:
                        transforms = _write_object(f, index.objects[key], source, fetcher, slab_bytes)
                        written.append(_Written(key, None, name, start, f.tell() - start, transforms))
                    else:
                        _write_item(f, index.tensors[key], box, fetcher, slab_bytes, progress, layout.exact_chunks)
                        written.append(_Written(key, box, name, start, f.tell() - start))
                    pos = f.tell()
                if pending:
                    f.write(pending)
            return written

        return run

    weights = [
        sum(box.numel * itemsize(index.tensors[key].dtype) for key, box in per_rank[r])
        for r in range(layout.world_size)
    ]
    results = run_jobs([job(r) for r in range(layout.world_size)], ctx.workers, group=out.group, weights=weights)
    out.write_bytes(".metadata", build_metadata(index, [w for ws in results for w in ws], layout.key_order))
    return [data_file(r) for r in range(layout.world_size)] + [".metadata"]


def _in_order(
    items: list[tuple[str, Box]], index: CheckpointIndex, layout: Layout, rank: int
) -> list[tuple[str, Box | None]]:
    """A rank's items in file order: its tensor chunks, then (on the values' rank) the values;
    or, when the layout gives the state dict's key order, tensors and values in that order, as
    torch's planner writes them (a value's box is None)."""
    values: list[tuple[str, Box | None]] = [(k, None) for k in index.objects if _object_rank(layout, k) == rank]
    if layout.key_order is None:
        return list(items) + values
    position = {k: i for i, k in enumerate(layout.key_order)}
    both = list(items) + values
    return sorted(both, key=lambda kb: position.get(kb[0], len(position)))  # stable: a tensor's slabs stay in order


def _object_rank(layout: Layout, key: str) -> int:
    """The rank whose file holds value `key`: rank 0, unless the layout places values (a mesh
    layout puts each where torch's planner does)."""
    return 0 if layout.object_ranks is None else layout.object_ranks.get(key, 0)


def _write_item(
    f: Any, entry: TensorEntry, box: Box, fetcher: Fetcher, slab_bytes: int, progress: Progress, by_runs: bool = False
) -> None:
    """One chunk as a torch.save archive. A chunk that is a flat range of its tensor (every
    FSDP2 dim-0 slab) is streamed as a virtual tensor, so plain bytes move in the kernel; so is
    any chunk when `by_runs` (a mesh layout's whole chunks, e.g. TP's Shard(1)), as one reference
    per contiguous run of its rows; anything else is assembled in memory and written by torch.save."""
    start = _flat_start(entry.shape, box)
    if start is None and not by_runs:
        import torch

        t = fetcher.fetch(entry, box)
        torch.save(t, f)
        progress.advance(t.numel() * t.element_size())
        return
    pieces = (
        (
            [Piece(FlatRange(0, box.numel), Location(entry.key, start, box.numel, REF))]
            if start is not None
            else _runs(entry, box)
        )
        if box.numel
        else []
    )
    item = TensorEntry(f"{entry.key}@{list(box.offsets)}", entry.dtype, box.sizes, pieces, attrs={"virtual": True})
    write_archive_to(f, LazyTensor(item), fetcher, slab_bytes=slab_bytes, progress=progress)


def _small_item(entry: TensorEntry, box: Box, fetcher: Fetcher, slab_bytes: int) -> bytes | None:
    """The archive _write_item writes for a small chunk that is one flat run of its tensor (a
    DCP item of a small tensor), as bytes, so a run of them is written with one call; None
    where _write_item must write it."""
    if not box.numel:
        return None
    start = _flat_start(entry.shape, box)
    if start is None:
        return None
    return small_tensor_archive(entry, box.sizes, start, fetcher, slab_bytes)


def _runs(entry: TensorEntry, box: Box) -> list[Piece]:
    """The box as references to its contiguous runs in the tensor's row-major flattening: the
    dims after `d` are whole, so each index of the dims before `d` is one run."""
    shape = tuple(entry.shape)
    d = len(shape) - 1
    while d > 0 and box.sizes[d] == shape[d]:
        d -= 1
    run = box.sizes[d]
    for e in range(d + 1, len(shape)):
        run *= shape[e]
    strides = geometry.row_major_strides(shape)
    pieces: list[Piece] = []
    out = 0
    for index in itertools.product(*(range(o, o + n) for o, n in zip(box.offsets[:d], box.sizes[:d]))):
        src = sum(i * st for i, st in zip(index, strides)) + box.offsets[d] * strides[d]
        pieces.append(Piece(FlatRange(out, run), Location(entry.key, src, run, REF)))
        out += run
    return pieces


def _flat_start(shape: tuple[int, ...], box: Box) -> int | None:
    """The flat index of the box's first element when the box is one contiguous run of the
    tensor's row-major flattening (every dimension after its first non-unit one is whole)."""
    sizes = tuple(box.sizes)
    if 0 in sizes:  # no elements
        return 0
    first = 0
    while first < len(sizes) and sizes[first] == 1:
        first += 1
    shape = tuple(shape)
    if sizes[first + 1 :] != shape[first + 1 :]:
        return None
    strides = _STRIDES.get(shape)
    if strides is None:
        strides = geometry.row_major_strides(shape)
        if len(_STRIDES) < 4096:
            _STRIDES[shape] = strides
    return sum(map(operator.mul, box.offsets, strides))


_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}  # row-major strides by shape (a few shapes, many chunks)


def _write_object(
    f: Any, obj: ObjectEntry, source: Source | None, fetcher: Fetcher, slab_bytes: int
) -> tuple[str, ...]:
    """Copy a DCP bytes item verbatim when we have its bytes (`source` is given only as the DCP
    checkpoint the object was read from); otherwise write the value as a torch.save archive
    (stand-ins re-emitted as torch's and foreign classes)."""
    loc = obj.location
    if loc is not None and source is not None and loc.encoding in (Encoding.TORCH_SAVE, Encoding.BYTES):
        f.write(source.read(loc.file, loc.offset, loc.length))
        return tuple(loc.transforms)
    if isinstance(obj.data, (bytes, bytearray)) and loc is not None and loc.encoding == Encoding.BYTES:
        f.write(obj.data)
        return ()
    write_archive_to(f, obj.data, fetcher, slab_bytes=slab_bytes)
    return ()


def _md(name: str, **state: Any) -> Any:
    return stand_in(_METADATA + name, **state)


def _storage_info(file: str, offset: int, length: int, transforms: tuple[str, ...] = ()) -> Any:
    info = {"relative_path": file, "offset": offset, "length": length}
    if transforms:  # _StorageInfo pickles without its None fields
        info["transform_descriptors"] = list(transforms)
    return stand_in(_STORAGE_INFO, **info)


def _tensor_properties(dtype: str) -> Any:
    """TensorProperties as its __getstate__ pickles it: (dtype, layout, requires_grad,
    memory-format code, pin_memory)."""
    return stand_in(_METADATA + "TensorProperties", _state=(DType(dtype), _STRIDED, False, _CONTIGUOUS, False))


def build_metadata(index: CheckpointIndex, written: list[_Written], key_order: list[str] | None = None) -> bytes:
    """`.metadata`: torch's Metadata for what was written, field for field as torch pickles it.
    `key_order`: the state dict's key order, which torch keeps in planner_data (None: as written).
    Written as opcodes straight from `written` (metadata_pickle), or where that declines, by
    pickling the stand-ins: the same bytes."""
    collecting = gc.isenabled()
    if collecting:  # a few objects per chunk, alive until it returns, no cycles: full collections over
        gc.disable()  # the whole index would free nothing
    try:
        # the save id is a digest of what was written, so one plan gives the same bytes however
        # many processes wrote it (and a rerun gives the same checkpoint)
        save_id = uuid.uuid5(
            uuid.NAMESPACE_URL, "ckptkit-dcp:" + repr([(w.key, w.box, w.file, w.offset, w.length) for w in written])
        ).hex
        fast = metadata_pickle(index, written, key_order, save_id, DCP_VERSION)
        if fast is not None:
            return fast
        return dumps(metadata_stand_ins(index, written, key_order, save_id), protocol=2)
    finally:
        if collecting:
            gc.enable()


def metadata_stand_ins(
    index: CheckpointIndex, written: list[_Written], key_order: list[str] | None, save_id: str
) -> Any:
    """torch's Metadata for what was written, as stand-ins with the state torch's pickling gives each class."""
    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    for w in written:
        # the index's own key objects and interned file names: results gathered from other ranks
        # are copies, and pickle's memo follows object identity, so this keeps the bytes the same
        file = sys.intern(w.file)
        if w.box is None:
            obj = index.objects[w.key]
            key = obj.key
            sd_meta[key] = _md("BytesStorageMetadata")
            storage[_md("MetadataIndex", fqn=key, index=None)] = _storage_info(file, w.offset, w.length, w.transforms)
            planner[key] = tuple(obj.path) if obj.path else (key,)
            continue
        entry = index.tensors[w.key]
        key = entry.key
        meta = sd_meta.get(key)
        if meta is None:
            meta = _md(
                "TensorStorageMetadata", properties=_tensor_properties(entry.dtype), size=Size(entry.shape), chunks=[]
            )
            sd_meta[key] = meta
            planner[key] = tuple(entry.path) if entry.path else (key,)
        chunks = meta.__dict__["chunks"]
        chunks.append(_md("ChunkStorageMetadata", offsets=Size(w.box.offsets), sizes=Size(w.box.sizes)))
        storage[_md("MetadataIndex", fqn=key, index=len(chunks) - 1, offset=Size(w.box.offsets))] = _storage_info(
            file, w.offset, w.length
        )
    if key_order is not None:
        position = {k: i for i, k in enumerate(key_order)}
        planner = {k: planner[k] for k in sorted(planner, key=lambda k: position.get(k, len(position)))}
    return _md(
        "Metadata",
        state_dict_metadata=sd_meta,
        planner_data=planner,
        storage_data=storage,
        storage_meta=_md("StorageMeta", checkpoint_id=None, save_id=save_id, load_id=None, modules=[]),
        version=DCP_VERSION,
    )
