"""Index numpy's .npy files (one tensor each, as numpy.save writes them): the header parsed by
numpy's own reader, the data a raw little-endian span after it."""

from __future__ import annotations

import io
import math

import numpy as np
from numpy.lib import format as npy

from ckptkit.errors import FormatError
from ckptkit.index.types import Box, CheckpointIndex, Location, Piece, TensorEntry
from ckptkit.storage.source import Source

FORMAT = "npy"
SUFFIX = ".npy"
MAGIC = npy.MAGIC_PREFIX  # b"\x93NUMPY"
MAX_HEADER = (1 << 16) + 10  # a version 1 header's length field is 16 bits


def npy_files(source: Source) -> list[str]:
    return sorted(n for n in source.listdir("") if n.endswith(SUFFIX) and not source.isdir(n))


def is_npy(source: Source, name: str) -> bool:
    return source.size(name) >= 10 and source.read(name, 0, len(MAGIC)) == MAGIC


def read_index(source: Source, names: list[str]) -> CheckpointIndex:
    index = CheckpointIndex(format=FORMAT, root=source.root, world_size=1)
    for name in names:
        key = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
        shape, dtype, offset = _header(source, name)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes != source.size(name):
            raise FormatError(f"{source.label(name)}: holds {source.size(name) - offset} data bytes, expected {nbytes}")
        location = Location(name, offset, nbytes)
        index.add_tensor(
            TensorEntry(key, dtype.name, shape, [Piece(Box.whole(shape), location)], path=tuple(key.split(".")))
        )
        index.files[name] = source.size(name)
    return index


def _header(source: Source, name: str) -> tuple[tuple[int, ...], np.dtype, int]:
    label = source.label(name)
    if not is_npy(source, name):
        raise FormatError(f"{label}: not a .npy file (no numpy magic)")
    head = io.BytesIO(source.read(name, 0, min(source.size(name), MAX_HEADER)))
    try:
        major, _ = npy.read_magic(head)
        read = npy.read_array_header_1_0 if major == 1 else npy.read_array_header_2_0
        shape, fortran_order, dtype = read(head)
    except ValueError as exc:
        raise FormatError(f"{label}: a damaged .npy header ({exc})") from None
    if fortran_order or dtype.hasobject or dtype.byteorder == ">":
        raise FormatError(f"{label}: only C-ordered little-endian numbers are read ({dtype.str})")
    return tuple(shape), dtype, head.tell()
