"""The structure of an opened checkpoint, read from its index and its files' sizes alone: every
piece inside its file and sized for its region, every tensor covered exactly once. `verify`
reports these; choosing the newest complete checkpoint of a run folder or a Checkpointer
directory asks them too, below the operations."""

from __future__ import annotations

from ..errors import CkptkitError, FormatError
from ..index import geometry, problems as P
from ..index.dtypes import itemsize
from ..index.problems import Problem
from ..index.strides import strided_span
from ..index.types import Box, CheckpointIndex, Encoding, FlatRange, TensorEntry
from .opened import Opened

# Top-level keys that hold a model's state dict: Lightning's `state_dict`, DeepSpeed's `module`,
# accelerate's and FSDP full state dicts' `model`, the `model_state_dict` of training scripts
# (convert/keys.MODEL_CONTAINERS, where the model is looked for; the formats layer cannot import it).
STATE_DICT_KEYS = ("model", "module", "state_dict", "model_state_dict")


def structural_problems(opened: Opened) -> list[str]:
    """The sentences of structural_findings (one per problem)."""
    return [p.message for p in structural_findings(opened)]


def structural_findings(opened: Opened, skip: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """Pieces inside their files and sized for their regions; each tensor covered exactly once.
    Tensors in `skip` lost pieces to a problem already listed: their coverage is not checked."""
    index, source = opened.index, opened.source
    problems: list[Problem] = []
    for key, t in index.tensors.items():
        item = itemsize(t.dtype)
        for p in t.pieces:
            loc = p.location
            label = source.label(loc.file)
            try:
                size = source.size(loc.file)
            except CkptkitError as exc:
                problems.append(Problem(P.kind_of(exc), f"tensor {key}: {exc}", label, key))
                continue
            if loc.offset < 0 or loc.offset + loc.length > size:
                problems.append(
                    Problem(
                        P.TRUNCATED,
                        f"{label}: tensor {key} bytes {loc.offset}..{loc.offset + loc.length} "
                        f"lie past the end of the file ({size} bytes)",
                        label,
                        key,
                    )
                )
            if loc.encoding == Encoding.RAW:
                if isinstance(p.region, FlatRange) or loc.stride is None:
                    expected = p.region.numel * item
                else:
                    expected = strided_span(tuple(p.region.sizes), tuple(loc.stride)) * item
                if loc.length != expected:
                    problems.append(
                        Problem(
                            P.SIZE_MISMATCH,
                            f"{label}: tensor {key} piece holds {loc.length} bytes, its region needs {expected}",
                            label,
                            key,
                        )
                    )
            if isinstance(p.region, Box) and p.region.ndim != len(t.shape):
                problems.append(
                    Problem(
                        P.FORMAT,
                        f"tensor {key}: piece has rank {p.region.ndim}, tensor has rank {len(t.shape)}",
                        label,
                        key,
                    )
                )
        if t.attrs.get("alias_of") or key in skip:
            continue
        where = source.label(t.pieces[0].location.file) if t.pieces else opened.path
        problems += _coverage_findings(key, t, where)
    return problems


def _coverage_findings(key: str, t: TensorEntry, where: str) -> list[Problem]:
    """The tensor's pieces against its shape: outside it, elements in no piece, elements twice."""
    problems: list[Problem] = []
    cov = geometry.coverage(t.shape, [p.region for p in t.pieces])
    if cov.out_of_bounds:
        problems.append(
            Problem(
                P.OUT_OF_BOUNDS,
                f"tensor {key} {list(t.shape)}: {len(cov.out_of_bounds)} "
                f"piece(s) lie outside the tensor, e.g. {_region_text(cov.out_of_bounds[0])}",
                where,
                key,
            )
        )
    if cov.missing:
        problems.append(
            Problem(
                P.COVERAGE_GAP,
                f"tensor {key} {list(t.shape)}: {cov.missing_elements} "
                f"element(s) are in no piece, e.g. {_region_text(cov.missing[0])}",
                where,
                key,
            )
        )
    if cov.doubled:
        problems.append(
            Problem(
                P.COVERAGE_OVERLAP,
                f"tensor {key} {list(t.shape)}: elements are stored twice, e.g. {_region_text(cov.doubled[0])}",
                where,
                key,
            )
        )
    return problems


def _region_text(region) -> str:
    if isinstance(region, Box):
        return f"offsets {list(region.offsets)} sizes {list(region.sizes)}"
    return f"flat range {region.start}..{region.end}"


def check_listed_state_dicts(index: CheckpointIndex, label: str) -> None:
    """The same refusal for any format's index (a DCP folder flattens a list under "model" to
    model.0, model.1): a tensor whose path is a known state-dict key then a list position."""
    for e in index.tensors.values():
        path = e.path
        if path and len(path) > 1 and type(path[1]) is int and path[0] in STATE_DICT_KEYS:
            raise FormatError(
                f"{label}: {path[0]!r} is a list of values, expected a mapping of parameter names "
                f"to tensors (a state dict)"
            )
