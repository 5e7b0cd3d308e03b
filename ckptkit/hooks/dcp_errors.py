"""torch's CheckpointException turned back into ckptkit's one sentence.

`dcp.load` catches every exception of every rank's planning and reading and raises a
CheckpointException (a BaseException) whose text is each rank's traceback. A ckptkit error inside
it is returned as is; torch's own planner refusals of a state dict against the checkpoint (a key
the checkpoint lacks, a shape that differs) are worded as ckptkit.load words them.
"""
from __future__ import annotations

import re

from ..errors import CkptkitError, FormatError, name_of

_MISSING = re.compile(r"^Missing key in checkpoint state_dict: (?P<key>.*)\.$", re.S)
_SIZE = re.compile(r"^Size mismatch between saved (?P<saved>torch\.Size\(\[.*?\]\)) and current: "
                   r"(?P<current>torch\.Size\(\[.*?\]\)) for (?P<key>.*)$", re.S)


def failures_of(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside a CheckpointException, lowest rank first (else [exc])."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return [exc]
    out = []
    for rank in sorted(failures):
        pair = failures[rank]
        inner = pair[0] if isinstance(pair, tuple) and pair else pair
        out.append(inner if isinstance(inner, BaseException) else exc)
    return out


def unwrap_exception(exc: BaseException, path: str, tensors: list[str]) -> BaseException:
    """ckptkit's error for what `exc` (from dcp.load over the checkpoint at `path`, whose tensors
    the reader shows as `tensors`) reports; `exc` itself where it is neither a ckptkit error nor a
    refusal torch's planner words."""
    inner = failures_of(exc)
    for e in inner:
        if isinstance(e, CkptkitError):
            return e
    for e in inner:
        worded = _worded(e, path, tensors)
        if worded is not None:
            return worded
    return exc


def _worded(exc: BaseException, path: str, tensors: list[str]) -> CkptkitError | None:
    text = str(exc.args[0]) if exc.args else ""
    missing = _MISSING.match(text)
    if missing:
        sample = ", ".join(name_of(k) for k in tensors[:3])
        return FormatError(f"{path}: has no {name_of(missing['key'])} (the checkpoint holds {len(tensors)} "
                           f"tensors, e.g. {sample})")
    size = _SIZE.match(text)
    if size:
        return FormatError(f"{path}: {name_of(size['key'])} has shape {_dims(size['saved'])} in the checkpoint, "
                           f"the state dict expects {_dims(size['current'])}")
    return None


def _dims(size_text: str) -> str:
    """`torch.Size([3, 4])` as `[3, 4]`, the way ckptkit.load writes shapes."""
    return size_text[len("torch.Size("):-1]
