"""The read plan: which bytes a region of a logical tensor is read from, as typed, frozen values.

Planning is pure (no IO): `plan_reads(index, entry, box)` walks the pieces that overlap `box` and
returns a ReadPlan of ReadSpans, each one positional read (or one decoded item, one virtual fill)
saying where its elements land. It validates as it plans, with the sentences users already know:
the pieces tile the tensor exactly once, the box is covered, a read stays inside the piece's
recorded bytes (and inside its file, when sizes are given), a reference names a tensor of the
index. `Fetcher` (runner/fetch.py) executes plans; `byte_ranges` and `ckptkit plan` are views of
them. The shape follows torch.distributed.checkpoint: typed ReadItem/LoadPlan values (planner.py),
planning before storage IO (storage.py), a validation pass (default_planner._validate_global_plan).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple

from ..errors import FormatError
from ..index import geometry
from ..index.dtypes import itemsize
from ..index.types import Box, CheckpointIndex, Encoding, FlatRange, TensorEntry
from ..index.virtual import TableEntry
from ..torch_types import SmallTensor
from .flat_plan import coalesce, flat_byte_ranges
from .piece_lookup import PieceLookup

if TYPE_CHECKING:  # numpy is imported when a flat table is first planned, not by every command
    from ..storage.range_table import RangeTable
    from .flat_table import SourceRuns

__all__ = ["Encoding", "Planner", "ReadPlan", "ReadSpan", "check_tiling", "plan_byte_ranges", "plan_reads"]

_ENCODINGS = {e.value: e for e in Encoding}  # str -> member (a dict lookup: Encoding(x) is slow)

ByteRange = tuple["str | bytes | None", int, int]
_LOOKUP_PIECES = 32  # a tensor of this many pieces or more is planned through a PieceLookup


class ReadSpan(NamedTuple):
    """One read of one piece, and where its elements land. Immutable (a NamedTuple: a fetch of a
    small tensor builds one, and a frozen dataclass costs four times as much to build).

    `file`, `offset`, `length` by encoding: RAW, the file and the bytes from the first element
    read to the last; TORCH_SAVE, the encoded item (decoded whole or streamed); REF, the referenced
    tensor's key, its first flat element and the element count; ZEROS and INLINE, no file.
    """

    key: str  # the tensor whose piece is read
    piece: int  # index of that piece in the tensor's pieces
    encoding: Encoding
    file: str
    offset: int
    length: int
    box: Box  # the elements read, in the tensor's coordinates
    region: Box  # the piece's box holding them (one run of a flat piece)
    base: int  # element offset of region's first element in the piece's storage
    strides: tuple[int, ...] | None  # element strides in that storage (None: the decoded item's own)
    dense: bool  # RAW: the bytes are one run, in the box's row-major order
    refs: tuple[ReadPlan, ...] = ()  # REF: plans of the referenced tensor's boxes, in flat order


class ReadPlan(NamedTuple):
    """Every span that fills `box` of tensor `key`, each element exactly once."""

    key: str
    dtype: str
    box: Box
    spans: tuple[ReadSpan, ...]

    def walk(self) -> Iterator[ReadSpan]:
        """Every span, with the spans of referenced tensors after the REF span that needs them."""
        for span in self.spans:
            yield span
            for ref in span.refs:
                yield from ref.walk()

    def bytes_per_file(self) -> dict[str, int]:
        """Bytes read from each file (an item several spans take elements of counts once)."""
        seen: set[tuple[str, int, int]] = set()
        totals: dict[str, int] = {}
        for span in self.walk():
            if (
                span.encoding in (Encoding.RAW, Encoding.TORCH_SAVE)
                and (span.file, span.offset, span.length) not in seen
            ):
                seen.add((span.file, span.offset, span.length))
                totals[span.file] = totals.get(span.file, 0) + span.length
        return totals

    def encodings(self) -> dict[str, int]:
        """How many spans each encoding has."""
        return dict(Counter(str(span.encoding) for span in self.walk()))


def _as_is(rel: str) -> str:
    return rel


def check_tiling(entry: TensorEntry, label: Callable[[str], str] = _as_is) -> None:
    """Refuse a tensor whose pieces do not cover it exactly once.

    Counting filled elements is not enough (a doubled row and a missing row add up), and a gap
    would otherwise leave uninitialised memory in the output.
    """
    cov = geometry.coverage(entry.shape, [p.region for p in entry.pieces], max_report=1)
    if cov.exact:
        return
    if cov.out_of_bounds:
        why = "a piece lies outside the tensor"
    elif cov.missing:
        b = cov.missing[0]
        why = (
            f"{cov.missing_elements} element(s) are in no piece (e.g. offsets {list(b.offsets)} sizes {list(b.sizes)})"
        )
    else:
        b = cov.doubled[0]
        why = f"elements are stored twice (e.g. offsets {list(b.offsets)} sizes {list(b.sizes)})"
    raise FormatError(
        f"{label('')}: tensor {entry.key} {list(entry.shape)} is not "
        f"tiled exactly by its pieces: {why}; run `ckptkit verify` for all problems"
    )


def plan_reads(
    index: CheckpointIndex | None,
    entry: TensorEntry,
    box: Box | None = None,
    *,
    label: Callable[[str], str] = _as_is,
    tiling: Callable[[TensorEntry], None] | None = None,
    file_sizes: Mapping[str, int] | None = None,
) -> ReadPlan:
    """The reads that fill `box` (default: the whole tensor) of `entry`, validated.

    `index` resolves REF pieces; `label` names a file in errors (the source's label); `tiling`
    replaces the exact-tiling check (a caller caching it per entry); `file_sizes`, when given,
    refuses a read past the end of its file before anything is read.
    """
    return Planner(index, label=label, tiling=tiling, file_sizes=file_sizes)(entry, box)


class Planner:
    """plan_reads with its settings bound, for a caller planning many reads (a Fetcher)."""

    def __init__(
        self,
        index: CheckpointIndex | None,
        *,
        label: Callable[[str], str] = _as_is,
        tiling: Callable[[TensorEntry], None] | None = None,
        file_sizes: Mapping[str, int] | None = None,
    ) -> None:
        self.index = index
        self.label = label
        self.tiling = tiling or (lambda e: check_tiling(e, label))
        self.file_sizes = file_sizes
        self._runs: dict[int, tuple[TensorEntry, tuple]] = {}  # flat_plan's runs of referenced tensors
        self._source_runs: SourceRuns | None = None  # flat_table's, made when a table is first planned
        self._lookups: dict[int, tuple[TensorEntry, int, PieceLookup | None]] = {}  # per entry of many pieces

    def __call__(self, entry: TensorEntry, box: Box | None = None) -> ReadPlan:
        self.tiling(entry)
        return self.plan(entry, box or Box((0,) * len(entry.shape), tuple(entry.shape)))

    def plan(self, entry: TensorEntry, box: Box) -> ReadPlan:
        """The spans of `box` of an entry whose tiling is checked (REF spans recurse here)."""
        spans = []
        filled = 0
        want = box.numel
        for i, sub, elem_offset in self._parts(entry, box):
            if sub == box:  # the common case (a whole tensor in one piece): the box itself, no arithmetic
                if want:
                    spans.append(self.span(entry, i, sub, elem_offset, box, want, True))
                    filled += want
                continue
            inter = geometry.intersect(sub, box)
            if inter is not None:
                n = inter.numel
                spans.append(self.span(entry, i, sub, elem_offset, inter, n, inter == sub))
                filled += n
        if filled != want:
            raise FormatError(
                f"{self.label('')}: tensor {entry.key} region {list(box.offsets)}+{list(box.sizes)} "
                f"is not covered by its pieces ({filled} of {want} elements found)"
            )
        return ReadPlan(entry.key, entry.dtype, box, tuple(spans))

    def _parts(self, entry: TensorEntry, box: Box) -> Iterator[tuple[int, Box, int]]:
        """(piece index, a box of the piece, its element offset) for the pieces that may meet
        `box`, in piece order: every piece of a tensor of few, the lookup's candidates otherwise."""
        if len(entry.pieces) >= _LOOKUP_PIECES:
            cached = self._lookups.get(id(entry))
            if cached is None or cached[0] is not entry or cached[1] != len(entry.pieces):
                cached = self._lookups[id(entry)] = (entry, len(entry.pieces), PieceLookup.of(entry))
            if cached[2] is not None:
                for i, _, sub, elem_offset in cached[2].meeting(box):
                    yield i, sub, elem_offset
                return
        for i, piece in enumerate(entry.pieces):
            region = piece.region
            if type(region) is Box:
                yield i, region, 0
            else:
                for sub, elem_offset in geometry.flat_to_boxes(region, entry.shape):
                    yield i, sub, elem_offset

    def span(self, entry: TensorEntry, i: int, sub: Box, elem_offset: int, inter: Box, n: int, whole: bool) -> ReadSpan:
        """The span reading `inter` (n elements; `whole`: all of `sub`) of piece i."""
        piece = entry.pieces[i]
        loc = piece.location
        encoding = _ENCODINGS.get(loc.encoding)
        flat = isinstance(piece.region, FlatRange)
        if encoding is Encoding.RAW:
            strides = geometry.row_major_strides(sub.sizes) if flat or loc.stride is None else tuple(loc.stride)
            dense = whole and (flat or loc.stride is None)
            if dense:  # the whole run of the piece, row-major
                first, last = elem_offset, elem_offset + n - 1
            else:
                local = [o - so for o, so in zip(inter.offsets, sub.offsets)]
                first = elem_offset + sum(p * st for p, st in zip(local, strides))
                last = first + sum((s - 1) * st for s, st in zip(inter.sizes, strides))
                dense = all(
                    size == 1 or st == want
                    for size, st, want in zip(inter.sizes, strides, geometry.row_major_strides(inter.sizes))
                )
            item = itemsize(entry.dtype)
            if first < 0 or (last + 1) * item > loc.length:
                raise FormatError(f"{self.label(loc.file)}: tensor {entry.key} reads past its recorded byte range")
            offset, length = loc.offset + first * item, (last - first + 1) * item
            if self.file_sizes is not None:
                self._inside_file(loc.file, offset + length)
            return ReadSpan(entry.key, i, encoding, loc.file, offset, length, inter, sub, elem_offset, strides, dense)
        if encoding is Encoding.TORCH_SAVE:
            self._inside_file(loc.file, loc.offset + loc.length)
            strides = geometry.row_major_strides(sub.sizes) if flat else None
            return ReadSpan(
                entry.key, i, encoding, loc.file, loc.offset, loc.length, inter, sub, elem_offset, strides, False
            )
        if encoding is Encoding.ZEROS:
            return ReadSpan(entry.key, i, encoding, "", 0, 0, inter, sub, elem_offset, None, False)
        if encoding is Encoding.INLINE:
            return ReadSpan(entry.key, i, encoding, "", 0, loc.length, inter, sub, elem_offset, None, False)
        if encoding is Encoding.REF:
            return self.ref(entry, i, sub, elem_offset, inter)
        raise FormatError(f"{self.label(loc.file)}: unknown piece encoding {str(loc.encoding)!r}")

    def ref(self, entry: TensorEntry, i: int, sub: Box, elem_offset: int, inter: Box) -> ReadSpan:
        """A virtual piece: elements of another logical tensor's row-major flattening."""
        loc = entry.pieces[i].location
        if self.index is None or loc.file not in self.index.tensors:
            raise FormatError(f"virtual tensor {entry.key} refers to unknown tensor {loc.file!r}")
        target = self.index.tensors[loc.file]
        strides = geometry.row_major_strides(sub.sizes)
        first = elem_offset + sum((o - so) * st for o, so, st in zip(inter.offsets, sub.offsets, strides))
        start = loc.offset + first
        if start + inter.numel > target.numel:
            raise FormatError(f"virtual tensor {entry.key} reads past the end of {target.key}")
        boxes = [box for box, _ in geometry.flat_to_boxes(FlatRange(start, inter.numel), target.shape)]
        if boxes:
            self.tiling(target)
        refs = [self.plan(target, box) for box in boxes]
        return ReadSpan(
            entry.key,
            i,
            Encoding.REF,
            loc.file,
            start,
            inter.numel,
            inter,
            sub,
            elem_offset,
            strides,
            False,
            tuple(refs),
        )

    def byte_ranges(self, entry: TensorEntry, start: int = 0, length: int | None = None) -> list[ByteRange] | None:
        """Elements [start, start+length) (default: to the end) of the entry's flattening as
        coalesced source byte ranges (see plan_byte_ranges), or None where they are not stored
        that simply. Flat layouts (ZeRO partitions) are planned by an interval sweep
        (flat_plan), which answers only for flat runs meeting end to end: an exact tiling, so
        not checked twice (20k ZeRO-3 parameters); the rest, and every refusal, through boxes,
        the tiling checked first. A flat table (a ZeRO partition) is planned from its table."""
        if start == 0 and length is None:
            found = self.ranges(entry)
            return found if found is None or isinstance(found, list) else found.as_list()
        return self._listed_ranges(entry, start, length)

    def ranges(self, entry: TensorEntry) -> RangeTable | list[ByteRange] | None:
        """The whole entry's byte ranges, each table planned once: a flat table's as arrays
        (range_table), else, or where its table is declined, as byte_ranges lists them."""
        if type(entry) is TableEntry:
            table = self.range_table(entry)
            if table is not None:
                return table
        return self._listed_ranges(entry, 0, None)

    def _listed_ranges(self, entry: TensorEntry, start: int, length: int | None) -> list[ByteRange] | None:
        """byte_ranges planned from the entry's pieces (not from a flat table)."""
        tensors = self.index.tensors if self.index is not None else None
        whole = start == 0 and length is None
        length = entry.numel - start if length is None else length
        fast = flat_byte_ranges(
            entry,
            start,
            length,
            tensors=tensors,
            tiling=self.tiling,
            boxed=self._boxed_range,
            file_sizes=self.file_sizes,
            cache=self._runs,
        )
        if fast is not None:
            return fast
        self.tiling(entry)
        if whole:
            return coalesce(plan_byte_ranges(self(entry), tensors, entry))
        return coalesce(self._boxed_range(entry, start, length))

    def range_table(self, entry: TensorEntry) -> RangeTable | None:
        """byte_ranges of a whole flat table (a ZeRO partition) as arrays, planned from the table
        (runner/flat_table.py); None where the entry is no table or its parts' tensors are not
        stored that simply (byte_ranges then plans its pieces, or refuses them)."""
        if type(entry) is not TableEntry or self.index is None:
            return None
        from .flat_table import SourceRuns, table_ranges

        if self._source_runs is None:
            self._source_runs = SourceRuns(self.index.tensors, self.file_sizes)
        return table_ranges(entry.table, entry.dtype, self._source_runs)

    def _boxed_range(self, entry: TensorEntry, start: int, length: int) -> list[ByteRange] | None:
        """byte_ranges of a flat range through N-d boxes: each box of the range planned, then
        viewed as byte ranges (None when one is not simple)."""
        tensors = self.index.tensors if self.index is not None else None
        out: list[ByteRange] = []
        for box, _ in geometry.flat_to_boxes(FlatRange(start, length), entry.shape):
            ranges = plan_byte_ranges(self.plan(entry, box), tensors, entry)
            if ranges is None:
                return None
            out += ranges
        return out

    def _inside_file(self, rel: str, end: int) -> None:
        size = self.file_sizes.get(rel) if self.file_sizes is not None else None
        if size is not None and end > size:
            raise FormatError(f"{self.label(rel)}: file ends before byte {end} (truncated?)")


def plan_byte_ranges(
    plan: ReadPlan, entries: Mapping[str, TensorEntry] | None, entry: TensorEntry
) -> list[ByteRange] | None:
    """The plan as source byte ranges in the box's row-major order: (file, offset, nbytes), or
    (None, 0, nbytes) for zero padding, or (bytes, offset, nbytes) for a small value in memory.
    None when some span is not stored that simply (strided, encoded, another dtype, a torch value
    in memory, a run that is not contiguous in the box). `entries` resolves REF spans' tensors."""
    item = itemsize(plan.dtype)
    if len(plan.spans) == 1 and plan.spans[0].box is plan.box:  # one span fills the box
        span = plan.spans[0]
        if span.encoding is Encoding.RAW and span.dense:
            return [(span.file, span.offset, span.length)]
        placed = [(0, span)]
    else:
        outer = geometry.row_major_strides(plan.box.sizes)
        placed = []
        for span in plan.spans:
            if not _is_run(span.box.sizes, plan.box.sizes):
                return None
            placed.append((sum((o - bo) * st for o, bo, st in zip(span.box.offsets, plan.box.offsets, outer)), span))
        placed.sort(key=lambda p: p[0])
    out: list[ByteRange] = []
    pos = 0
    for at, span in placed:
        if at != pos:
            return None
        n = span.box.numel
        if span.encoding is Encoding.RAW and span.dense:
            out.append((span.file, span.offset, n * item))
        elif span.encoding is Encoding.ZEROS:
            out.append((None, 0, n * item))
        elif span.encoding is Encoding.INLINE:
            value = entry.attrs.get("value")
            if not isinstance(value, SmallTensor):
                return None
            local = tuple(o - ro for o, ro in zip(span.box.offsets, span.region.offsets))
            first = sum(o * st for o, st in zip(local, geometry.row_major_strides(span.region.sizes)))
            out.append((value.data, first * item, n * item))
        elif span.encoding is Encoding.REF and entries is not None:
            for ref in span.refs:
                if ref.dtype != plan.dtype:
                    return None
                inner = plan_byte_ranges(ref, entries, entries[ref.key])
                if inner is None:
                    return None
                out.extend(inner)
        else:
            return None
        pos += n
    return out if pos == plan.box.numel else None


def _is_run(sizes: tuple[int, ...], outer: tuple[int, ...]) -> bool:
    """Whether a box of `sizes` inside a box of `outer` sizes is one run of its row-major order:
    after the first dimension it spans more than one index of, it spans every dimension whole."""
    spread = False
    for s, o in zip(sizes, outer):
        if spread and s != o:
            return False
        spread = spread or s > 1
    return True
