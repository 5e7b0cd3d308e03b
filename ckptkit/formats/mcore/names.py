"""What each item of a Megatron-Core distributed checkpoint is, from its key.

MCore flattens model and optimizer into one namespace of sharded keys. Its optimizer's
`sharded_state_dict` names per-parameter state `optimizer.state.<state>.<param key>` (`exp_avg`,
`exp_avg_sq`, and `param` for the fp32 master copy), prefixed `chained_<N>.` when several
optimizers are chained (dense and expert parameters). The distributed optimizer saved
`dp_reshardable` keeps its flat per-bucket buffers instead (`optimizer.distributed.…`): they
follow MCore's grad-buffer layout, so they cannot be mapped to parameters here; they are named as
such. Everything else is the model.
"""

from __future__ import annotations

import re
from typing import NamedTuple

OPTIMIZER_STATE = re.compile(r"(?:(chained_[0-9]+)\.)?optimizer\.state\.([A-Za-z_][A-Za-z0-9_]*)\.(.+)")
FLAT_BUFFER = re.compile(r"(?:(chained_[0-9]+)\.)?optimizer\.distributed\..+")


class Role(NamedTuple):
    """`path`: the canonical nesting ckptkit's roles read (convert/keys.py): ("model", key) for a
    model tensor, ("optimizer", "state", param, state) for a parameter's state, ("optimizer",
    "distributed", key) for a flat buffer of the distributed optimizer."""

    kind: str  # "model" | "optimizer" | "flat_buffer"
    path: tuple


def role_of(key: str) -> Role:
    found = OPTIMIZER_STATE.fullmatch(key)
    if found is not None:
        return Role("optimizer", ("optimizer", "state", found.group(3), found.group(2)))
    if FLAT_BUFFER.fullmatch(key):
        return Role("flat_buffer", ("optimizer", "distributed", key))
    return Role("model", ("model", key))
