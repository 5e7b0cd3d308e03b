"""The canonical index: what every reader produces and every operation consumes.

A checkpoint is a set of logical tensors (key, dtype, global shape), each made of pieces. A piece
says which region of the tensor it holds (an N-d box, or a range of the row-major flattening) and
where its bytes are (file, byte offset, length, encoding). Non-tensor values are objects. Readers
build an index and never decide what happens to the data; writers turn a layout into files.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any, Iterable, Iterator, NamedTuple, Union

from ..errors import FormatError, quote
from ..safeload import realize
from .dtypes import itemsize


@dataclass(frozen=True, slots=True)
class Box:
    """An N-d box of a tensor in global coordinates (0-d tensors use empty tuples)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box offsets {self.offsets} and sizes {self.sizes} differ in rank")

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @staticmethod
    def whole(shape: tuple[int, ...]) -> "Box":
        return Box(tuple(0 for _ in shape), tuple(shape))


@dataclass(frozen=True, slots=True)
class FlatRange:
    """Elements [start, start+length) of the tensor's row-major flattening (ZeRO partitions)."""

    start: int
    length: int

    @property
    def numel(self) -> int:
        return self.length

    @property
    def end(self) -> int:
        return self.start + self.length


Region = Union[Box, FlatRange]


class Encoding(StrEnum):
    """How a piece's (or a value's) bytes are stored. A str, so an index read back from JSON
    (plain strings) compares equal to these."""

    RAW = "raw"  # elements at ``offset`` with element ``stride`` (None: contiguous
    # row-major over the region; a FlatRange is always contiguous);
    # ``length`` is the byte span that holds them
    TORCH_SAVE = "torch_save"  # [offset, offset+length) is a whole torch.save archive holding the
    # piece as its only tensor (a DCP item, decoded first: ``transforms``)
    BYTES = "bytes"  # a DCP bytes item: a value's serialised bytes
    REF = "ref"  # virtual: elements [offset, offset+length) of the flattening of tensor ``file``
    ZEROS = "zeros"  # virtual: zero padding
    INLINE = "inline"  # virtual: a small value held in memory, in entry.attrs["value"]

    __hash__ = str.__hash__  # Enum hashes its name: equal to "raw", it must hash like "raw" too


@dataclass(frozen=True, slots=True)
class Location:
    """Where a piece's bytes live: ``file``, ``offset``, ``length`` as ``encoding`` reads them."""

    file: str
    offset: int
    length: int
    encoding: str = Encoding.RAW
    stride: tuple[int, ...] | None = None
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Piece:
    region: Region
    location: Location

    @property
    def numel(self) -> int:
        return self.region.numel


# Unchecked constructors. A reader making one piece per tensor and rank (100k+ tensors in a DCP
# checkpoint of small items, a ZeRO rank's 20k parameters x 3 flat tensors) would spend a
# microsecond a field in the frozen dataclasses' __init__ (object.__setattr__ per field); these
# set the slots directly through their member descriptors, so the object equals, hashes and reprs
# like the constructed one. No check runs (neither does the dataclasses' __init__ check types):
# the caller passes values it has already checked. The classes have slots, not a __dict__: a
# piece of a 100k-tensor index costs its fields, not three dicts (issue 17).
_new = object.__new__
_box_offsets, _box_sizes = Box.offsets.__set__, Box.sizes.__set__  # type: ignore[attr-defined]
_range_start, _range_length = FlatRange.start.__set__, FlatRange.length.__set__  # type: ignore[attr-defined]
_loc_file, _loc_offset, _loc_length = (
    Location.file.__set__,
    Location.offset.__set__,  # type: ignore[attr-defined]
    Location.length.__set__,
)  # type: ignore[attr-defined]
_loc_encoding, _loc_stride, _loc_transforms = (
    Location.encoding.__set__,
    Location.stride.__set__,  # type: ignore[attr-defined]
    Location.transforms.__set__,
)  # type: ignore[attr-defined]
_piece_region, _piece_location = Piece.region.__set__, Piece.location.__set__  # type: ignore[attr-defined]


def unchecked_box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
    """Box(offsets, sizes), made without the frozen dataclass's __init__ and its rank check
    (see above: the caller has checked that offsets and sizes have the same length)."""
    box = _new(Box)
    _box_offsets(box, offsets)
    _box_sizes(box, sizes)
    return box


def unchecked_flat_range(start: int, length: int) -> FlatRange:
    """FlatRange(start, length), made without the frozen dataclass's __init__ (see above)."""
    region = _new(FlatRange)
    _range_start(region, start)
    _range_length(region, length)
    return region


def unchecked_location(
    file: str,
    offset: int,
    length: int,
    encoding: str = Encoding.RAW,
    stride: tuple[int, ...] | None = None,
    transforms: tuple[str, ...] = (),
) -> Location:
    """Location(file, offset, length, encoding, stride, transforms), made without the frozen
    dataclass's __init__ (see above)."""
    loc = _new(Location)
    _loc_file(loc, file)
    _loc_offset(loc, offset)
    _loc_length(loc, length)
    _loc_encoding(loc, encoding)
    _loc_stride(loc, stride)
    _loc_transforms(loc, transforms)
    return loc


def unchecked_piece(region: Region, location: Location) -> Piece:
    """Piece(region, location), made without the frozen dataclass's __init__ (see above)."""
    piece = _new(Piece)
    _piece_region(piece, region)
    _piece_location(piece, location)
    return piece


@dataclass(slots=True)
class TensorEntry:
    """A logical tensor. ``path`` is the original nesting (keys, list indices) when known."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    path: tuple[Any, ...] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


_UNREALIZED = object()


@dataclass(slots=True)
class ObjectEntry:
    """A non-tensor value (step, hyperparameter, scheduler state, rng, config).

    ``data`` is the value as the restricted unpickler rebuilt it: plain Python, stand-ins for
    foreign classes and for torch's small types (ckptkit.torch_types: torch.Size, dtypes, small
    tensors), so indexing and copying need no torch. ``value`` is the same with torch's own
    objects, built on first use. ``location`` points at the original serialised bytes where a
    writer can copy them verbatim (a DCP bytes item).
    """

    key: str
    data: Any
    path: tuple[Any, ...] | None = None
    location: Location | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    _value: Any = field(default=_UNREALIZED, init=False, repr=False, compare=False)

    @property
    def value(self) -> Any:
        """`data` with torch.Size, dtypes and tensors from torch (imports torch if it holds any)."""
        if self._value is _UNREALIZED:
            try:
                self._value = realize(self.data)
            except RecursionError:
                raise FormatError(f"value {self.key} is nested too deeply to be a checkpoint value") from None
        return self._value


class Replica(NamedTuple):
    """Another copy of a tensor that must hold the same bytes: what it is (one phrase) and its entry."""

    what: str  # e.g. "model-parallel rank 1's copy"
    entry: TensorEntry


class IntegrityCheck(NamedTuple):
    """A byte range with a checksum the container carries (a zip member's CRC32). A NamedTuple:
    a DCP checkpoint of 100k small items has 700k of them (a frozen dataclass is 4x dearer to make)."""

    file: str
    offset: int
    length: int
    crc32: int
    what: str


_make_check = partial(tuple.__new__, IntegrityCheck)  # IntegrityCheck(*row) without its Python-level __new__
_U32 = "I" if array("I").itemsize >= 4 else "L"  # ids and CRC32s: 4 bytes each where C allows


class _Ids(dict):
    """Interned names (files, what a check covers): name -> id, with `names[id]` -> name."""

    __slots__ = ("names",)

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __missing__(self, name: str) -> int:
        self[name] = got = len(self.names)
        self.names.append(name)
        return got


class CheckTable:
    """An index's IntegrityChecks, held as columns: a DCP checkpoint of 100k small items has 700k
    checks, which as NamedTuples of Python ints cost ~1.1 kB a tensor; here ~200 B (issue 17).
    List-like for what the codebase does with `index.checks` (extend, append, iterate, len,
    index, compare with a list): iterating gives the same IntegrityCheck values that went in."""

    __slots__ = ("_ids", "_file", "_offset", "_length", "_crc32", "_what")

    def __init__(self, checks: Iterable[IntegrityCheck] = ()) -> None:
        self._ids = _Ids()
        self._file, self._what = array(_U32), array(_U32)
        self._offset, self._length, self._crc32 = array("q"), array("q"), array(_U32)
        self.extend(checks)

    def extend(self, checks: Iterable[IntegrityCheck]) -> None:
        """Add `checks` in order. Every column is built before any grows: a value no column holds
        (a CRC32 past 32 bits, an offset past 63) raises and leaves the table as it was."""
        if type(checks) is CheckTable:
            names = checks._ids.names
            rows = zip(
                map(names.__getitem__, checks._file),
                checks._offset,
                checks._length,
                checks._crc32,
                map(names.__getitem__, checks._what),
            )
        else:
            rows = checks
        columns = tuple(zip(*rows))
        if not columns:
            return
        files, offsets, lengths, crcs, whats = columns
        ids = self._ids.__getitem__
        new = (
            array(_U32, map(ids, files)),
            array("q", offsets),
            array("q", lengths),
            array(_U32, crcs),
            array(_U32, map(ids, whats)),
        )
        for column, added in zip((self._file, self._offset, self._length, self._crc32, self._what), new):
            column.extend(added)

    def add_members(
        self,
        file: str,
        base: int,
        ats: tuple[int, ...],
        lengths: tuple[int, ...],
        crc32s: tuple[int, ...],
        whats: tuple[str, ...],
    ) -> None:
        """The checks (file, base + at, length, crc32, what) of one archive's members, column by
        column, without making their tuples (the DCP reader's 100k templated items). The caller's
        values fit the columns (offsets in a file, CRC32s unpacked from 4 bytes): not checked."""
        ids = self._ids
        self._file.extend((ids[file],) * len(ats))
        self._offset.extend(map(base.__add__, ats))
        self._length.extend(lengths)
        self._crc32.extend(crc32s)
        self._what.extend(map(ids.__getitem__, whats))

    def append(self, check: IntegrityCheck) -> None:
        self.extend((check,))

    def __len__(self) -> int:
        return len(self._offset)

    def __iter__(self) -> Iterator[IntegrityCheck]:
        name = self._ids.names.__getitem__
        return map(
            _make_check, zip(map(name, self._file), self._offset, self._length, self._crc32, map(name, self._what))
        )

    def __getitem__(self, at: int | slice) -> Any:
        if isinstance(at, slice):
            return list(self)[at]
        name = self._ids.names
        return _make_check(
            (name[self._file[at]], self._offset[at], self._length[at], self._crc32[at], name[self._what[at]])
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (CheckTable, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  (mutable, like the list it stands for)

    def __repr__(self) -> str:
        return f"CheckTable({list(self)!r})"

    def __reduce__(self) -> tuple:
        return CheckTable, (list(self),)


class NameCollision(FormatError):
    """Two entries of one checkpoint flatten to the same name; `detail` is the sentence without
    the place, for a reader that knows the file better than the index's root."""

    def __init__(self, where: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.detail = detail


@dataclass
class CheckpointIndex:
    """Everything a reader learned about a checkpoint, with no payload loaded."""

    format: str
    root: str
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    world_size: int | None = None
    step: int | None = None
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes
    checks: CheckTable = field(default_factory=CheckTable)  # a list given is made one (__setattr__)
    metadata: dict[str, Any] = field(default_factory=dict)
    # format-specific parsed structures a writer of the same format needs (never serialised)
    native: Any = None
    # key -> the other copies a reader found that must hold the same bytes (a tensor-parallel
    # checkpoint's replicated tensors, saved by every tp rank): verify --deep compares them
    replicas: dict[str, list[Replica]] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "checks" and type(value) is not CheckTable:
            value = CheckTable(value)  # (index.checks = [...] and CheckpointIndex(checks=[...]) stay valid)
        object.__setattr__(self, name, value)

    def add_tensor(self, entry: TensorEntry) -> None:
        self._refuse_collision(entry.key, entry.path)
        self.tensors[entry.key] = entry

    def add_object(self, entry: ObjectEntry) -> None:
        self._refuse_collision(entry.key, entry.path)
        self.objects[entry.key] = entry

    def _refuse_collision(self, key: str, path: Any) -> None:
        """Two different entries whose paths join to one key ({"a.b": x, "a": {"b": y}}): one
        would silently hide the other, in every command. A reader replacing its own entry (the
        same path, or none) is not a collision."""
        old = self.tensors.get(key) or self.objects.get(key)
        if old is None or old.path is None or path is None or tuple(old.path) == tuple(path):
            return
        raise NameCollision(
            self.root,
            f"two entries have the same name {quote(key)} (at "
            f"{_shown(old.path)} and {_shown(path)}); ckptkit names an entry "
            f"by joining its path with '.', so one would hide the other",
        )

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _shown(path: Any) -> str:
    """A path as Python subscripts (['a.b'] vs ['a']['b']): what tells two colliding entries apart."""
    return "".join(
        f"[{quote(p) if isinstance(p, str) else int(p) if isinstance(p, int) else quote(str(p))}]" for p in path
    )
