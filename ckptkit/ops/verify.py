"""`ckptkit verify`: is every piece present, in bounds, and covering its tensor exactly?

--deep also reads every byte: CRC32s of the zip members that torch.save containers carry,
every tensor assembled from its pieces, and safetensors files opened by the safetensors library.
Every problem found is listed, each with its file, key and kind (index/problems.py): the readers
run under `problems.collecting()`, so a missing or damaged rank file is recorded and the other
files are still indexed and checked; tensors it left incomplete are not reported again as gaps.
The caller exits 0 only when the list is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import CkptkitError, StorageError, quote
from ..formats.registry import Opened, capabilities_of, open_checkpoint
from ..formats.structure import structural_findings
from ..index import geometry, problems as P
from ..index.problems import Problem
from ..index.dtypes import itemsize
from ..index.types import Box
from ..runner.fetch import Fetcher
from ..storage.checksum import crc32
from ..context import RunContext, context_of

if TYPE_CHECKING:
    import torch

CRC_BLOCK = 8 << 20


@dataclass
class Report:
    """What `verify` found in one checkpoint: `opened` is None when it could not be indexed."""

    path: str
    opened: Opened | None
    problems: list[Problem]
    deep: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.problems:
            out[p.kind] = out.get(p.kind, 0) + 1
        return dict(sorted(out.items()))

    def as_json(self) -> dict:
        """`verify --json`: ok, a summary, and every problem with its file, key and kind."""
        summary: dict = {
            "problems": len(self.problems),
            "by_kind": self.counts(),
            "deep": self.deep,
            "format": None,
            "tensors": None,
            "objects": None,
            "files": None,
        }
        if self.opened is not None:
            idx = self.opened.index
            summary.update(
                {
                    "format": idx.format,
                    "tensors": len(idx.tensors),
                    "objects": len(idx.objects),
                    "files": len(idx.files),
                }
            )
            if self.deep:
                summary["crc32_checked"] = len(idx.checks)
            if self.opened.trainer is not None:
                summary["trainer"] = self.opened.trainer.as_json()
        return {"path": self.path, "ok": self.ok, "summary": summary, "problems": [p.as_json() for p in self.problems]}


def check(
    path: str,
    deep: bool = False,
    options: RunContext | None = None,
    tag: str | None = None,
    *,
    ctx: RunContext | None = None,
) -> Report:
    """Every problem of the checkpoint at `path`: those met while indexing (a missing or damaged
    file, listed and stepped over where the rest can still be read), then structure, then --deep."""
    ctx = context_of(ctx, options)
    with P.collecting() as log:
        try:
            opened = open_checkpoint(path, tag=tag, follow_links=ctx.follow_links)
        except StorageError:
            raise  # SRC's storage cannot be opened at all (unknown protocol, no credentials): bad input
        except CkptkitError as exc:
            return Report(path, None, log.problems + [Problem(P.kind_of(exc), str(exc), path)], deep)
    found = list(log.problems)
    found += structural_findings(opened, skip=log.damaged)
    if opened.trainer is not None:  # an HF Trainer folder: its state file and RNG files too
        from .trainer_folder import folder_findings

        found += folder_findings(opened)
    if deep:  # a tensor already reported is not assembled again (it would fail for the same reason)
        found += deep_findings(opened, ctx, skip=log.damaged | {p.key for p in found if p.key})
    return Report(path, opened, found, deep)


def verify(
    path: str,
    deep: bool = False,
    options: RunContext | None = None,
    tag: str | None = None,
    *,
    ctx: RunContext | None = None,
) -> tuple[Opened | None, list[str]]:
    """(opened checkpoint or None, every problem's sentence); see check() for the details."""
    report = check(path, deep, tag=tag, ctx=context_of(ctx, options))
    return report.opened, [p.message for p in report.problems]


def deep_findings(opened: Opened, ctx: RunContext, skip: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """Every byte read: CRCs, every tensor assembled (except those in `skip`), safetensors files."""
    index = opened.index
    problems: list[Problem] = []
    tensors = [(k, t) for k, t in index.tensors.items() if not t.attrs.get("alias_of") and t.numel and k not in skip]
    ctx.progress.start(sum(c.length for c in index.checks) + sum(t.nbytes for _, t in tensors), "verify --deep")
    try:
        problems += _crc_problems(opened, ctx)
        problems += _tensor_problems(opened, tensors, ctx)
        problems += _replica_problems(opened, ctx, skip)
    finally:
        ctx.progress.close()
    if capabilities_of(index).library_check:
        problems += _safetensors_library_check(opened)
    return problems


def _crc_problems(opened: Opened, ctx: RunContext) -> list[Problem]:
    index, source = opened.index, opened.source
    problems: list[Problem] = []
    block = min(CRC_BLOCK, ctx.slab_bytes_for(1))  # one block held at a time, a share of the budget
    for check in index.checks:
        crc = 0
        pos = check.offset
        end = check.offset + check.length
        try:
            while pos < end:
                ctx.check()
                n = min(block, end - pos)
                crc = crc32(source.read(check.file, pos, n), crc)
                pos += n
                ctx.progress.advance(n)
        except CkptkitError as exc:
            problems.append(Problem(P.kind_of(exc), str(exc), source.label(check.file)))
            continue
        if crc != check.crc32:
            problems.append(
                Problem(
                    P.CRC_MISMATCH,
                    f"{source.label(check.file)}: {check.what} at byte "
                    f"{check.offset} fails its CRC (stored {check.crc32:08x}, computed "
                    f"{crc:08x}): the bytes were altered",
                    source.label(check.file),
                )
            )
    return problems


def _tensor_problems(opened: Opened, tensors: list, ctx: RunContext) -> list[Problem]:
    """Every tensor assembled from its pieces, slab by slab (decoding and bounds checked)."""
    problems: list[Problem] = []
    fetcher = Fetcher(opened.source, index=opened.index, memory_budget=ctx.memory_budget)
    for key, t in tensors:
        item = itemsize(t.dtype)
        try:
            for slab in geometry.split_rowmajor(Box.whole(t.shape), max(1, ctx.slab_bytes // item)):
                fetcher.fetch(t, slab)
                ctx.progress.advance(slab.numel * item)
        except CkptkitError as exc:
            kind = P.kind_of(exc)
            where = opened.source.label(t.pieces[0].location.file) if t.pieces else opened.path
            problems.append(Problem(P.UNREADABLE if kind == P.FORMAT else kind, f"tensor {key}: {exc}", where, key))
    return problems


def _replica_problems(opened: Opened, ctx: RunContext, skip: set[str] | frozenset[str]) -> list[Problem]:
    """Copies a reader says must equal a tensor (a tensor-parallel checkpoint's replicated
    tensors, saved by every tp rank: `index.replicas`), compared slab by slab."""
    replicas = opened.index.replicas
    if not replicas:
        return []
    problems: list[Problem] = []
    fetcher = Fetcher(opened.source, index=opened.index, memory_budget=ctx.memory_budget)
    for key, copies in replicas.items():
        t = opened.index.tensors.get(key)
        if t is None or key in skip or not t.numel:
            continue
        item = itemsize(t.dtype)
        for what, copy in copies:
            try:
                for slab in geometry.split_rowmajor(Box.whole(t.shape), max(1, ctx.slab_bytes_for(4) // item)):
                    ctx.check()
                    a, b = fetcher.fetch(t, slab), fetcher.fetch(copy, slab)
                    if not _same_bytes(a, b):
                        raise _Differs(slab)
            except _Differs as diff:
                where = opened.source.label(copy.pieces[0].location.file) if copy.pieces else opened.path
                problems.append(
                    Problem(
                        P.FORMAT,
                        f"tensor {key}: {what} ({where}) differs from the copy read "
                        f"(elements {list(diff.slab.offsets)}+{list(diff.slab.sizes)}); a "
                        f"replicated tensor must be the same on every rank",
                        where,
                        key,
                    )
                )
            except CkptkitError as exc:
                where = opened.source.label(copy.pieces[0].location.file) if copy.pieces else opened.path
                problems.append(Problem(P.UNREADABLE, f"tensor {key} ({what}): {exc}", where, key))
    return problems


def _same_bytes(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    import torch

    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class _Differs(Exception):
    def __init__(self, slab: Box) -> None:
        super().__init__()
        self.slab = slab


def _safetensors_library_check(opened: Opened) -> list[Problem]:
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
            problems.append(Problem(P.kind_of(exc), str(exc), path))
        except Exception as exc:  # the library raises its own error types
            problems.append(
                Problem(P.FORMAT, f"{path}: the safetensors library rejects the file ({quote(str(exc), 200)})", path)
            )
    return problems
