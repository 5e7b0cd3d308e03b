"""The names a StorageReader shows torch's planner: the index's keys under the containers the
caller's state dict uses.

ckptkit's canonical names are what `get_state_dict` gives under `{"model": ..., "optim": ...}`:
`model.<fqn>`, `optim.state.<fqn>.<what>`, `optim.param_groups.<g>.<hyper>`. Other stacks nest
differently: torchtitan keeps the model's names at the top level and its optimizer under
`optimizer`, Lightning under `state_dict` and `optimizer_0`. `model_prefix` and `optim_prefix`
replace the two containers. An optimizer state dict flattened by torch
(`flatten_optimizer_state_dict=True`, torchtitan's) names each group's values per parameter,
`param_groups.<fqn>.<hyper>`: those names are shown too, each reading its group's value.
"""

from __future__ import annotations

import re

from ..errors import UsageError
from ..index.types import CheckpointIndex

MODEL, OPTIM = "model.", "optim."
_GROUP = re.compile(r"^optim\.param_groups\.(\d+)\.(.+)$")


def check_prefix(option: str, prefix: object) -> str:
    """A container prefix: "" (top level) or names ending with a dot."""
    if not isinstance(prefix, str) or (prefix and (not prefix.endswith(".") or prefix.startswith("."))):
        raise UsageError(
            f"ckptkit.StorageReader: {option}={prefix!r} must be '' (top level) or a name ending "
            f"with '.' (e.g. 'model.')"
        )
    return prefix


def presented_names(index: CheckpointIndex, model_prefix: str = MODEL, optim_prefix: str = OPTIM) -> dict[str, str]:
    """Shown name -> index key, for every tensor and value of `index` (in index order), plus the
    per-parameter names of each optimizer group's values."""
    names: dict[str, str] = {}
    for key in list(index.tensors) + list(index.objects):
        names.setdefault(_renamed(key, model_prefix, optim_prefix), key)
    for key in index.objects:
        group = _GROUP.match(key)
        if group is None or group[2] == "params":
            continue
        params = index.objects.get(f"optim.param_groups.{group[1]}.params")
        for fqn in params.value if params is not None and isinstance(params.value, list) else ():
            if isinstance(fqn, str):
                names.setdefault(f"{optim_prefix}param_groups.{fqn}.{group[2]}", key)
    return names


def _renamed(key: str, model_prefix: str, optim_prefix: str) -> str:
    if key.startswith(MODEL):
        return model_prefix + key[len(MODEL) :]
    if key.startswith(OPTIM):
        return optim_prefix + key[len(OPTIM) :]
    return key
