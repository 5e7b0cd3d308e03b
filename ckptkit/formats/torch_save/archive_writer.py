"""Write any structure as a torch.save archive, streaming its tensors.

Leaves may be plain values, stand-ins (re-emitted as their original classes), small in-memory
tensors (torch's, or SmallTensors read from a checkpoint), or LazyTensor(entry): a logical tensor (possibly virtual)
whose bytes are streamed slab
by slab from the source when the archive is written. The layout is torch's own: <root>/data.pkl,
<root>/data/<n> (64-byte aligned), byteorder, version; torch.load(weights_only=False) and
frameworks that use it (DeepSpeed) read it back. Writing needs no torch unless the structure
holds torch tensors.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ...index.dtypes import STORAGE_OF, dtype_name, itemsize
from ...index.lazy import LazyTensor
from ...index.types import TensorEntry
from ...lazy_torch import is_tensor
from ...progress import NullProgress, Progress
from ...repickle import GlobalRef, dumps, fast_dumps
from ...torch_types import DType, SmallTensor
from ...runner.fetch import Fetcher
from ...runner.stream import stream_tensor, tensor_bytes
from ...storage import kernel_copy, range_table
from ...storage.commit import Output
from . import zip_records

if TYPE_CHECKING:
    import torch

ROOT = "archive"
ALIGN = 64
# an archive whose tensors hold at most this many bytes (a DCP item of a small tensor) is
# assembled in memory and written with one call, instead of a write per zip record
SMALL_ARCHIVE = 1 << 16
_DATE = (1980, 1, 1, 0, 0, 0)
_REBUILD_V2 = GlobalRef("torch._utils", "_rebuild_tensor_v2")
_REBUILD_V3 = GlobalRef("torch._utils", "_rebuild_tensor_v3")
_UNTYPED = GlobalRef("torch", "UntypedStorage")
_LEGACY_STORAGE = {dtype: GlobalRef("torch", legacy) for dtype, legacy in STORAGE_OF.items()}  # (one object per name)


class _Slot:
    """One storage record of the archive: streamed from `lazy`, or `data` held in memory."""

    def __init__(
        self, key: str, dtype: str, numel: int, lazy: TensorEntry | None, data: "torch.Tensor | bytes | None"
    ) -> None:
        self.key, self.dtype, self.numel, self.lazy, self.data = key, dtype, numel, lazy, data


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


# the only types _Builder's hooks answer for (a torch tensor, which they also answer for, makes
# repickle's fast writer decline: FaithfulPickler then writes the structure)
_HOOKED = (LazyTensor, SmallTensor, _Slot)


class _Builder:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No slots (a declined fast pickling's are forgotten)."""
        self.slots: list[_Slot] = []
        self._by_entry: dict[int, _Slot] = {}
        self._by_ptr: dict[tuple, _Slot] = {}

    def _lazy_slot(self, e: TensorEntry) -> _Slot:
        """The storage record of a LazyTensor's entry (one per entry, however often it is met)."""
        slot = self._by_entry.get(id(e))
        if slot is None:
            slot = _Slot(str(len(self.slots)), e.dtype, e.numel, e, None)
            self.slots.append(slot)
            self._by_entry[id(e)] = slot
        return slot

    def _slot_for(self, obj: Any) -> tuple[_Slot, int, tuple, tuple]:
        if isinstance(obj, LazyTensor):
            e = obj.entry
            return self._lazy_slot(e), 0, tuple(e.shape), _contiguous_stride(tuple(e.shape))
        if isinstance(obj, SmallTensor):
            slot = _Slot(str(len(self.slots)), obj.dtype, obj.numel, None, obj.data)
            self.slots.append(slot)
            return slot, 0, obj.shape, _contiguous_stride(obj.shape)
        import torch

        t: torch.Tensor = obj.detach().cpu()
        storage = t.untyped_storage()
        ptr = (storage.data_ptr(), storage.nbytes(), t.dtype)
        slot = self._by_ptr.get(ptr)
        if slot is None:
            whole = torch.empty((0,), dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),))
            slot = _Slot(str(len(self.slots)), dtype_name(t.dtype), whole.numel(), None, whole)
            self.slots.append(slot)
            self._by_ptr[ptr] = slot
        return slot, t.storage_offset(), tuple(t.shape), tuple(t.stride())

    def reduce(self, obj: Any) -> Any:
        if type(obj) is LazyTensor:  # _slot_for's first case, inlined: a placeholder per parameter (20k)
            e = obj.entry
            slot = self._lazy_slot(e)
            shape = tuple(e.shape)
            if slot.dtype in STORAGE_OF:
                return (_REBUILD_V2, (slot, 0, shape, _contiguous_stride(shape), False, OrderedDict()))
            return (_REBUILD_V3, (slot, 0, shape, _contiguous_stride(shape), False, OrderedDict(), DType(slot.dtype)))
        if not isinstance(obj, (LazyTensor, SmallTensor)):
            if not is_tensor(obj):
                return None
            import torch

            if isinstance(obj, torch.nn.Parameter):
                obj = obj.data
        slot, offset, shape, stride = self._slot_for(obj)
        # the arguments torch's Tensor.__reduce_ex__ gives (size as a plain tuple)
        if slot.dtype in STORAGE_OF:
            return (_REBUILD_V2, (slot, offset, tuple(shape), tuple(stride), False, OrderedDict()))
        return (_REBUILD_V3, (slot, offset, tuple(shape), tuple(stride), False, OrderedDict(), DType(slot.dtype)))

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _Slot):
            return None
        legacy = _LEGACY_STORAGE.get(obj.dtype)
        if legacy is not None:
            return ("storage", legacy, obj.key, "cpu", obj.numel)
        return ("storage", _UNTYPED, obj.key, "cpu", obj.numel * itemsize(obj.dtype))


def _pickle(structure: Any, builder: _Builder) -> bytes:
    """data.pkl of `structure`, its tensors' storages recorded in `builder`: repickle's fast
    writer where it serves (plain containers, stand-ins, lazy and small tensors), else the
    FaithfulPickler on a fresh builder; the same bytes either way."""
    data = fast_dumps(structure, builder.persistent_id, builder.reduce, _HOOKED)
    if data is None:
        builder.reset()
        data = dumps(structure, protocol=2, persistent_id=builder.persistent_id, reduce_hook=builder.reduce)
    return data


def _aligned_info(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_STORED
    header_start = zf.fp.tell()  # type: ignore[union-attr]
    data_start = header_start + 30 + len(name.encode()) + 20  # + the zip64 extra force_zip64 adds
    pad = (-(data_start + 4)) % ALIGN
    info.extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad  # torch's own padding record id
    return info


def copy_in_kernel(
    member: Any, f: Any, source: Any, ranges: "kernel_copy.Ranges | range_table.RangeTable", progress: Progress
) -> bool:
    """Fill a zip member straight from source byte ranges (see storage.kernel_copy; a RangeTable's
    through storage.range_table); the zip record's CRC32 is computed as they are copied (zipfile
    writes it into the record's local header when the member closes). False (nothing written)
    where the source is not local or the member is not the standard library's zip writer."""
    if not (
        kernel_copy.available(source) and all(hasattr(member, a) for a in ("_crc", "_file_size", "_compress_size"))
    ):
        return False
    if isinstance(ranges, list):
        total, crc = kernel_copy.copy_with_crc(source, ranges, f, progress.advance)
    else:
        total, crc = range_table.copy_with_crc(source, ranges, f, progress.advance)
    member._crc, member._file_size, member._compress_size = crc, total, total
    return True


def _read_ranges(source: Any, ranges: "kernel_copy.Ranges | range_table.RangeTable") -> bytes:
    """The bytes of a tensor's ranges (Fetcher.ranges: a RangeTable or a list), in memory."""
    if isinstance(ranges, list):
        return kernel_copy.read(source, ranges)
    return range_table.read(source, ranges)


def write_archive(
    out: Output, name: str, structure: Any, fetcher: Fetcher, *, slab_bytes: int, progress: Progress | None = None
) -> None:
    """Write `structure` as the torch.save file `name` inside `out`."""
    with out.open(name) as f:
        write_archive_to(f, structure, fetcher, slab_bytes=slab_bytes, progress=progress)


class _Window:
    """The rest of an open file seen as a new file starting at the current position, so an
    archive appended to a DCP data file has offsets relative to its own start."""

    def __init__(self, f: Any) -> None:
        self._f, self._base = f, f.tell()

    def write(self, data: Any) -> int:
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell() - self._base

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            return self._f.seek(self._base + pos) - self._base
        return self._f.seek(pos, whence) - self._base

    def seekable(self) -> bool:
        return True

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()


def write_archive_to(
    f: Any, structure: Any, fetcher: Fetcher, *, slab_bytes: int, progress: Progress | None = None
) -> None:
    """Append `structure` as a self-contained torch.save archive at f's current position."""
    progress = progress or NullProgress()
    builder, pickle_bytes, payload = _pickled(structure)
    if payload > min(SMALL_ARCHIVE, slab_bytes):
        _write_zip(_Window(f), f, builder, pickle_bytes, fetcher, slab_bytes, progress)
        return
    _write_small(f, structure, builder, pickle_bytes, payload, fetcher, slab_bytes, progress)


def small_archive_bytes(
    structure: Any, fetcher: Fetcher, *, slab_bytes: int, progress: Progress | None = None
) -> bytes | None:
    """The bytes write_archive_to writes for `structure` when its tensors are small enough to be
    assembled in memory (the same bytes, built once, serve several files that would be written
    alike); None, having read nothing, when they are not."""
    progress = progress or NullProgress()
    builder, pickle_bytes, payload = _pickled(structure)
    if payload > min(SMALL_ARCHIVE, slab_bytes):
        return None
    buf = io.BytesIO()
    _write_small(buf, structure, builder, pickle_bytes, payload, fetcher, slab_bytes, progress)
    return buf.getvalue()


def _pickled(structure: Any) -> tuple[_Builder, bytes, int]:
    """The archive's storage records, its data.pkl and the bytes of its tensors."""
    builder = _Builder()
    pickle_bytes = _lone_tensor_pickle(structure, builder) if type(structure) is LazyTensor else None
    if pickle_bytes is None:
        pickle_bytes = _pickle(structure, builder)
    return builder, pickle_bytes, sum(slot.numel * itemsize(slot.dtype) for slot in builder.slots)


def _write_small(
    f: Any,
    structure: Any,
    builder: _Builder,
    pickle_bytes: bytes,
    payload: int,
    fetcher: Fetcher,
    slab_bytes: int,
    progress: Progress,
) -> None:
    """An archive whose tensors are held in memory: its bytes assembled, then written at once."""
    if type(structure) is LazyTensor and _write_from_template(f, builder, pickle_bytes, payload, fetcher):
        progress.advance(payload)
        return
    whole = _records_archive(builder, pickle_bytes, fetcher, slab_bytes, progress)
    if whole is None:
        buf = io.BytesIO()  # same offsets as the window: both start at 0
        _write_zip(buf, None, builder, pickle_bytes, fetcher, slab_bytes, progress)
        whole = buf.getvalue()
    f.write(whole)


def _records_archive(
    builder: _Builder, pickle_bytes: bytes, fetcher: Fetcher, slab_bytes: int, progress: Progress
) -> bytes | None:
    """The bytes _write_zip writes for a small archive (its tensors' bytes held in memory), with
    each zip record packed directly (zip_records), not through zipfile's per-member objects: a
    ZeRO-3 model-states file is 20k empty placeholder tensors. None where the records would not
    be zipfile's bytes on this Python (then zipfile writes it). An empty tensor reads nothing."""
    if not zip_records.matches_zipfile(_DATE, ALIGN):
        return None
    records = zip_records.Records(_DATE)
    records.add(f"{ROOT}/data.pkl", pickle_bytes)
    records.add(f"{ROOT}/byteorder", b"little")
    for slot in builder.slots:
        if slot.lazy is not None:
            if slot.numel == 0:
                data = b""
            else:
                ranges = fetcher.ranges(slot.lazy)
                if ranges is not None:
                    data = _read_ranges(fetcher.source, ranges)
                else:
                    data = b"".join(bytes(c) for c in stream_tensor(fetcher, slot.lazy, None, slab_bytes))
                progress.advance(len(data))
        elif isinstance(slot.data, bytes):
            data = slot.data
        else:
            data = bytes(tensor_bytes(slot.data))
        try:
            records.add(f"{ROOT}/data/{slot.key}", data, ALIGN)
        except OverflowError:
            return None
    records.add(f"{ROOT}/version", b"3\n")
    return records.finish()


# data.pkl of an archive holding one LazyTensor, by (dtype, shape): its only inputs
_LONE_TENSOR_PICKLES: dict[tuple[str, tuple[int, ...]], bytes] = {}
_LONE_TENSOR_ENTRIES = 4096


def _lone_tensor_pickle(structure: LazyTensor, builder: _Builder) -> bytes:
    """data.pkl for a DCP item (one LazyTensor, whose storage is slot "0"), pickled once per dtype
    and shape: a checkpoint of 100k same-shaped tensors would otherwise run the pickler 100k
    times for the same bytes. `builder` gets the slot the pickler would have made."""
    entry = structure.entry
    key = (entry.dtype, tuple(entry.shape))
    known = _LONE_TENSOR_PICKLES.get(key)
    if known is not None:
        builder.reduce(structure)  # the slot, exactly as pickling would make it
        return known
    data = _pickle(structure, builder)
    if len(_LONE_TENSOR_PICKLES) < _LONE_TENSOR_ENTRIES:
        _LONE_TENSOR_PICKLES[key] = data
    return data


class _Template:
    """The bytes zipfile writes for an archive of one storage record of `nbytes`, with the two
    places that depend on the record's bytes: its CRC32 (local header and central directory) and
    its data. Made by zipfile itself and checked against it before use (see _template)."""

    def __init__(self, blank: bytes, data_at: int, nbytes: int, crc_at: tuple[int, int]) -> None:
        self.blank, self.data_at, self.nbytes, self.crc_at = blank, data_at, nbytes, crc_at

    def fill(self, data: bytes) -> bytes:
        out = bytearray(self.blank)
        out[self.data_at : self.data_at + self.nbytes] = data
        crc = _CRC.pack(zlib.crc32(data))
        for at in self.crc_at:
            out[at : at + 4] = crc
        return bytes(out)


_CRC = struct.Struct("<I")
# archives of one storage record by (data.pkl, record bytes): None where zipfile's bytes did not
# follow the template (then zipfile writes every such archive)
_TEMPLATES: dict[tuple[bytes, int], _Template | None] = {}
_TEMPLATE_ENTRIES = 4096


def _zip_of(pickle_bytes: bytes, data: bytes) -> bytes:
    """What _write_zip writes for data.pkl and one storage record holding `data`."""
    builder = _Builder()
    builder.slots.append(_Slot("0", "uint8", len(data), None, data))
    buf = io.BytesIO()
    _write_zip(buf, None, builder, pickle_bytes, None, 1 << 20, NullProgress())  # type: ignore[arg-type]
    return buf.getvalue()


def _template(pickle_bytes: bytes, nbytes: int) -> _Template | None:
    """The template for this data.pkl and record size, made once: zipfile writes the archive
    for zero bytes, the record's data and CRC fields are found from the zip directory, and the
    template must then give exactly zipfile's bytes for a second, different record."""
    key = (pickle_bytes, nbytes)
    if key in _TEMPLATES:
        return _TEMPLATES[key]
    from ...runner.zip_directory import plain_directory

    blank = _zip_of(pickle_bytes, bytes(nbytes))
    made = None
    found = plain_directory(blank)
    records = [e for e in found[0] if e.filename == f"{ROOT}/data/0"] if found is not None else []
    if len(records) == 1:
        entry = records[0]
        name_len, extra_len = struct.unpack_from("<HH", blank, entry.header_offset + 26)
        data_at = entry.header_offset + 30 + name_len + extra_len
        central_crc = _central_crc_at(blank, found[1], f"{ROOT}/data/0")
        if central_crc is not None:
            candidate = _Template(blank, data_at, nbytes, (entry.header_offset + 14, central_crc))
            probe = bytes((i * 7 + 1) % 251 for i in range(nbytes))
            if candidate.fill(probe) == _zip_of(pickle_bytes, probe):
                made = candidate
    if len(_TEMPLATES) < _TEMPLATE_ENTRIES:
        _TEMPLATES[key] = made
    return made


def _central_crc_at(blank: bytes, start: int, name: str) -> int | None:
    """Where the CRC32 of member `name` lies in the central directory starting at `start`."""
    at = start
    raw = name.encode()
    while blank[at : at + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", blank, at + 28)
        if blank[at + 46 : at + 46 + name_len] == raw:
            return at + 16
        at += 46 + name_len + extra_len + comment_len
    return None


def _write_from_template(f: Any, builder: _Builder, pickle_bytes: bytes, payload: int, fetcher: Fetcher) -> bool:
    """A small archive of one LazyTensor (a DCP item) from its template: its bytes read from
    their ranges, the CRC computed, no zipfile. False where there is no template or the bytes
    are not plain ranges (zipfile then writes it)."""
    if len(builder.slots) != 1 or builder.slots[0].lazy is None:
        return False
    template = _template(pickle_bytes, payload)
    if template is None:
        return False
    ranges = fetcher.byte_ranges(builder.slots[0].lazy)
    if ranges is None:
        return False
    data = kernel_copy.read(fetcher.source, ranges)
    if len(data) != payload:
        return False
    f.write(template.fill(data))
    return True


def small_tensor_archive(
    entry: TensorEntry, shape: tuple[int, ...], start: int, fetcher: Fetcher, slab_bytes: int
) -> bytes | None:
    """The archive write_archive_to writes for a LazyTensor of `shape` holding elements
    [start, start + numel) of `entry`'s flattening (a DCP item that is one flat run of its
    tensor), as bytes: its template filled from the run's byte ranges, with no virtual entry,
    builder or pickler per item. None where write_archive_to must write it (a payload too large,
    empty, or not plain bytes; a data.pkl or template not made yet: the first item of each dtype
    and shape makes them)."""
    numel = 1
    for n in shape:
        numel *= n
    payload = numel * itemsize(entry.dtype)
    if payload == 0 or payload > min(SMALL_ARCHIVE, slab_bytes):
        return None
    pickle_bytes = _LONE_TENSOR_PICKLES.get((entry.dtype, shape))
    if pickle_bytes is None:
        return None
    template = _TEMPLATES.get((pickle_bytes, payload))
    if template is None:
        return None
    ranges = fetcher.byte_ranges(entry, start, numel)
    if ranges is None:
        return None
    data = kernel_copy.read(fetcher.source, ranges)
    return template.fill(data) if len(data) == payload else None


def _write_zip(
    zip_file: Any, f: Any, builder: _Builder, pickle_bytes: bytes, fetcher: Fetcher, slab_bytes: int, progress: Progress
) -> None:
    """The archive's records into `zip_file`; tensors copied in the kernel into `f` where it is
    given, else read from their byte ranges (no torch needed either way)."""
    with zipfile.ZipFile(zip_file, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr(zipfile.ZipInfo(f"{ROOT}/data.pkl", _DATE), pickle_bytes)
        zf.writestr(zipfile.ZipInfo(f"{ROOT}/byteorder", _DATE), b"little")
        for slot in builder.slots:
            with zf.open(_aligned_info(zf, f"{ROOT}/data/{slot.key}"), "w", force_zip64=True) as member:
                # a flat table (a ZeRO partition) as its range arrays, other tensors as a list of ranges
                ranges = fetcher.ranges(slot.lazy) if slot.lazy is not None else None
                if ranges is not None and f is None:  # assembled in memory: the byte ranges, read
                    data = _read_ranges(fetcher.source, ranges)
                    member.write(data)
                    progress.advance(len(data))
                    continue
                if ranges is not None and copy_in_kernel(member, f, fetcher.source, ranges, progress):
                    continue
                if slot.lazy is not None:
                    for chunk in stream_tensor(fetcher, slot.lazy, None, slab_bytes):
                        member.write(chunk)
                        progress.advance(len(chunk))
                elif isinstance(slot.data, bytes):
                    member.write(slot.data)
                else:
                    member.write(tensor_bytes(slot.data))
        zf.writestr(zipfile.ZipInfo(f"{ROOT}/version", _DATE), b"3\n")
