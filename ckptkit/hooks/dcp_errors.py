"""torch's CheckpointException turned back into ckptkit's one sentence.

`dcp.load` catches every exception of every rank's planning and reading and raises a
CheckpointException (a BaseException) whose text is each rank's traceback. The cause inside it is
found as for saves (framework_errors: a ckptkit error or an OSError, returned as is); torch's own
planner refusals of a state dict against the checkpoint (a key the checkpoint lacks, a shape that
differs) are worded as ckptkit.load words them.
"""

from __future__ import annotations

import re

from ..errors import CkptkitError, FormatError, name_of
from ..framework_errors import failures_of, framework_cause

_MISSING = re.compile(r"^Missing key in checkpoint state_dict: (?P<key>.*)\.$", re.S)
_SIZE = re.compile(
    r"^Size mismatch between saved (?P<saved>torch\.Size\(\[.*?\]\)) and current: "
    r"(?P<current>torch\.Size\(\[.*?\]\)) for (?P<key>.*)$",
    re.S,
)


def unwrap_exception(exc: BaseException, path: str, tensors: list[str]) -> BaseException:
    """ckptkit's error for what `exc` (from dcp.load over the checkpoint at `path`, whose tensors
    the reader shows as `tensors`) reports; the first failure itself (no dump) where it is neither
    a ckptkit error, an OSError nor a refusal torch's planner words."""
    cause = framework_cause(exc)
    if isinstance(cause, CkptkitError):
        return cause
    for e in failures_of(exc):
        worded = _worded(e, path, tensors)
        if worded is not None:
            return worded
    return cause


def _worded(exc: BaseException, path: str, tensors: list[str]) -> CkptkitError | None:
    text = str(exc.args[0]) if exc.args else ""
    missing = _MISSING.match(text)
    if missing:
        sample = ", ".join(name_of(k) for k in tensors[:3])
        return FormatError(
            f"{path}: has no {name_of(missing['key'])} (the checkpoint holds {len(tensors)} tensors, e.g. {sample})"
        )
    size = _SIZE.match(text)
    if size:
        return FormatError(
            f"{path}: {name_of(size['key'])} has shape {_dims(size['saved'])} in the checkpoint, "
            f"the state dict expects {_dims(size['current'])}"
        )
    return None


def _dims(size_text: str) -> str:
    """`torch.Size([3, 4])` as `[3, 4]`, the way ckptkit.load writes shapes."""
    return size_text[len("torch.Size(") : -1]
