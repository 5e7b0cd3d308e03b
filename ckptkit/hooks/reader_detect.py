"""Whether ckptkit recognises a checkpoint at a path, from names and headers only.

torch picks a StorageReader by asking each candidate's `validate_checkpoint_id(path)`; the answer
must be cheap (it runs before any load) and must never raise. Nothing here indexes or unpickles:
a folder is looked at by its listing (and a few small headers), a file by its first bytes.
"""

from __future__ import annotations

import os

from ..errors import CkptkitError
from ..formats.registry import detect
from ..storage.source import local_path, open_source


def readable(checkpoint_id: object) -> bool:
    """True when `checkpoint_id` names a checkpoint ckptkit would open (a DCP, DeepSpeed,
    safetensors or torch.save folder or file, accelerate's parts, a run folder); False for
    anything else, a path that is not there, or an object that is no path."""
    try:
        path = local_path(os.fspath(checkpoint_id))  # type: ignore[arg-type]
    except TypeError:
        return False
    if not isinstance(path, str) or not path:
        return False
    try:
        source = open_source(path)
        if source.isdir(""):  # the registry's own loop, the kinds that wrap another passed over unasked
            return bool(detect(source))
        parent, name = os.path.split(path.rstrip("/"))
        return bool(detect(open_source(parent or ".", only=name), name))
    except (CkptkitError, OSError, ValueError):
        return False
