"""`ckptkit verify`: is every piece present, in bounds, and covering its tensor exactly?

--deep also reads every byte: CRC32s of the zip members that torch.save containers carry,
every tensor assembled from its pieces, and safetensors files opened by the safetensors library.
Every problem found is listed; the caller exits 0 only when the list is empty.
"""
from __future__ import annotations

from ..errors import CkptkitError, quote
from ..formats.registry import Opened, open_checkpoint
from ..formats.torch_save.archive import tensor_span_elems
from ..index import geometry
from ..index.dtypes import itemsize
from ..index.types import Box, FlatRange
from ..runner.fetch import Fetcher
from ..storage.checksum import crc32
from .options import RunOptions

CRC_BLOCK = 8 << 20


def verify(path: str, deep: bool = False, options: RunOptions | None = None,
           tag: str | None = None) -> tuple[Opened | None, list[str]]:
    """(opened checkpoint or None, problems). Structural errors while reading become problems."""
    options = options or RunOptions()
    try:
        opened = open_checkpoint(path, tag=tag, follow_links=options.follow_links)
    except CkptkitError as exc:
        return None, [str(exc)]
    problems = structural_problems(opened)
    if deep:
        problems += deep_problems(opened, options)
    return opened, problems


def structural_problems(opened: Opened) -> list[str]:
    index, source = opened.index, opened.source
    problems: list[str] = []
    for key, t in index.tensors.items():
        item = itemsize(t.dtype)
        for p in t.pieces:
            loc = p.location
            try:
                size = source.size(loc.file)
            except CkptkitError as exc:
                problems.append(f"tensor {key}: {exc}")
                continue
            if loc.offset < 0 or loc.offset + loc.length > size:
                problems.append(f"{source.label(loc.file)}: tensor {key} bytes {loc.offset}..{loc.offset + loc.length} "
                                f"lie past the end of the file ({size} bytes)")
            if loc.encoding == "raw":
                if isinstance(p.region, FlatRange) or loc.stride is None:
                    expected = p.region.numel * item
                else:
                    expected = tensor_span_elems(p.region.sizes, loc.stride) * item
                if loc.length != expected:
                    problems.append(f"{source.label(loc.file)}: tensor {key} piece holds {loc.length} bytes, "
                                    f"its region needs {expected}")
            if isinstance(p.region, Box) and p.region.ndim != len(t.shape):
                problems.append(f"tensor {key}: piece has rank {p.region.ndim}, tensor has rank {len(t.shape)}")
        if t.attrs.get("alias_of"):
            continue
        cov = geometry.coverage(t.shape, [p.region for p in t.pieces])
        if cov.out_of_bounds:
            problems.append(f"tensor {key} {list(t.shape)}: {len(cov.out_of_bounds)} piece(s) lie outside "
                            f"the tensor, e.g. {_region_text(cov.out_of_bounds[0])}")
        if cov.missing:
            problems.append(f"tensor {key} {list(t.shape)}: {cov.missing_elements} element(s) are in no piece, "
                            f"e.g. {_region_text(cov.missing[0])}")
        if cov.doubled:
            problems.append(f"tensor {key} {list(t.shape)}: elements are stored twice, "
                            f"e.g. {_region_text(cov.doubled[0])}")
    return problems


def _region_text(region) -> str:
    if isinstance(region, Box):
        return f"offsets {list(region.offsets)} sizes {list(region.sizes)}"
    return f"flat range {region.start}..{region.end}"


def deep_problems(opened: Opened, options: RunOptions) -> list[str]:
    index, source = opened.index, opened.source
    problems: list[str] = []
    tensors = [(k, t) for k, t in index.tensors.items() if not t.attrs.get("alias_of") and t.numel]
    options.progress.start(sum(c.length for c in index.checks) + sum(t.nbytes for _, t in tensors),
                           "verify --deep")
    try:
        problems += _crc_problems(opened, options)
        problems += _tensor_problems(opened, tensors, options)
    finally:
        options.progress.close()
    if index.format == "safetensors":
        problems += _safetensors_library_check(opened)
    return problems


def _crc_problems(opened: Opened, options: RunOptions) -> list[str]:
    index, source = opened.index, opened.source
    problems: list[str] = []
    for check in index.checks:
        crc = 0
        pos = check.offset
        end = check.offset + check.length
        try:
            while pos < end:
                n = min(CRC_BLOCK, end - pos)
                crc = crc32(source.read(check.file, pos, n), crc)
                pos += n
                options.progress.advance(n)
        except CkptkitError as exc:
            problems.append(str(exc))
            continue
        if crc != check.crc32:
            problems.append(f"{source.label(check.file)}: {check.what} at byte {check.offset} fails its CRC "
                            f"(stored {check.crc32:08x}, computed {crc:08x}): the bytes were altered")
    return problems


def _tensor_problems(opened: Opened, tensors: list, options: RunOptions) -> list[str]:
    """Every tensor assembled from its pieces, slab by slab (decoding and bounds checked)."""
    problems: list[str] = []
    fetcher = Fetcher(opened.source, index=opened.index, memory_budget=options.memory_budget)
    for key, t in tensors:
        item = itemsize(t.dtype)
        try:
            for slab in geometry.split_rowmajor(Box.whole(t.shape), max(1, options.slab_bytes // item)):
                fetcher.fetch(t, slab)
                options.progress.advance(slab.numel * item)
        except CkptkitError as exc:
            problems.append(f"tensor {key}: {exc}")
    return problems


def _safetensors_library_check(opened: Opened) -> list[str]:
    """The safetensors library itself must accept every file (it validates the header too)."""
    import os

    from safetensors import safe_open

    from ..storage.source import LocalSource

    if not isinstance(opened.source, LocalSource):
        return []
    problems = []
    for rel in opened.index.files:
        path = os.path.join(opened.source.root, rel)
        try:  # the very file the source checked (a regular file inside the checkpoint)
            with safe_open(opened.source.opened_path(rel), framework="pt") as f:
                list(f.keys())
        except CkptkitError as exc:
            problems.append(str(exc))
        except Exception as exc:  # the library raises its own error types
            problems.append(f"{path}: the safetensors library rejects the file ({quote(str(exc), 200)})")
    return problems
