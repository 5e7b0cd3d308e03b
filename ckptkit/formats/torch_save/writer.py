"""Write a torch.save file from an index, streaming storages without building the state dict.

The archive is written with the standard library's zipfile (stored, zip64-capable), laid out as
torch does it: <root>/data.pkl, <root>/data/<n> payloads 64-byte aligned, byteorder, version.
Tied tensors (same bytes in the source) share one storage, as in the original file.
"""
from __future__ import annotations

import pickle
import zipfile
from typing import Any

import torch

from ...index.dtypes import torch_dtype
from ...index.flatten import unflatten
from ...index.types import CheckpointIndex
from ...progress import NullProgress, Progress
from ...runner.fetch import Fetcher
from ...runner.stream import find_aliases, stream_tensor
from ...storage.output import OutputDir

ROOT = "archive"
ALIGN = 64


class _StorageSlot:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorSlot:
    def __init__(self, storage: _StorageSlot, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: int):
        from collections import OrderedDict

        stride = []
        acc = 1
        for s in reversed(self.shape):
            stride.append(acc)
            acc *= s
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, torch.Size(self.shape), tuple(reversed(stride)), False, OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageSlot):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


def _aligned_info(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    header_start = zf.fp.tell()  # type: ignore[union-attr]
    data_start = header_start + 30 + len(name.encode()) + 20  # zip64 extra written by force_zip64
    pad = (-(data_start + 4)) % ALIGN
    info.extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad  # torch's own padding record id
    return info


def write_torch_save(out: OutputDir, name: str, index: CheckpointIndex, fetcher: Fetcher, *,
                     slab_bytes: int, keys: list[str] | None = None, include_objects: bool = True,
                     key_map: dict[str, tuple] | None = None, progress: Progress | None = None) -> None:
    """Write index tensors (and objects) as one torch.save file `name` in `out`."""
    progress = progress or NullProgress()
    keys = list(index.tensors) if keys is None else keys
    aliases = find_aliases({k: index.tensors[k] for k in keys})
    slots: dict[str, _StorageSlot] = {}
    items: list[tuple[tuple, Any]] = []
    for n, key in enumerate(k for k in keys if k not in aliases):
        e = index.tensors[key]
        slots[key] = _StorageSlot(str(n), torch_dtype(e.dtype), e.numel)
    for key in keys:
        e = index.tensors[key]
        path = (key_map or {}).get(key) or (tuple(e.path) if e.path else (key,))
        items.append((path, _TensorSlot(slots[aliases.get(key, key)], e.shape)))
    if include_objects:
        for obj in index.objects.values():
            items.append(((key_map or {}).get(obj.key) or (tuple(obj.path) if obj.path else (obj.key,)), obj.value))
    structure = unflatten(items)
    import io

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(structure)
    with out.open(name) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr(zipfile.ZipInfo(f"{ROOT}/data.pkl", (1980, 1, 1, 0, 0, 0)), buf.getvalue())
        zf.writestr(zipfile.ZipInfo(f"{ROOT}/byteorder", (1980, 1, 1, 0, 0, 0)), b"little")
        for key, slot in slots.items():
            info = _aligned_info(zf, f"{ROOT}/data/{slot.key}")
            with zf.open(info, "w", force_zip64=True) as member:
                for chunk in stream_tensor(fetcher, index.tensors[key], None, slab_bytes):
                    member.write(chunk)
                    progress.advance(len(chunk))
        zf.writestr(zipfile.ZipInfo(f"{ROOT}/version", (1980, 1, 1, 0, 0, 0)), b"3\n")
