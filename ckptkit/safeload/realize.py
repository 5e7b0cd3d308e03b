"""torch's own objects in place of the stand-ins the unpickler built, where values leave ckptkit
for torch code or the user (ObjectEntry.value, diff and convert arithmetic, the Checkpointer's
extras). Beside the stand-ins of foreign classes (inert) rather than in torch_types, which sits
below this package and knows none of it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..index.dtypes import torch_dtype
from ..torch_types import DType, GlobalRef, Size, SmallTensor
from .inert import Inert, qualname_of


def realize(value: Any) -> Any:
    """`value` with torch's own objects in place of the stand-ins (imports torch only if it
    holds any); containers are rebuilt, everything else is returned as is."""
    if isinstance(value, SmallTensor):
        return value.to_torch()
    if isinstance(value, DType):
        return torch_dtype(value.name)
    if isinstance(value, Size):
        import torch

        return torch.Size(value)
    if isinstance(value, Inert):
        return _realize_inert(value)
    if isinstance(value, GlobalRef) and value.module == "torch":
        import torch

        return getattr(torch, value.name)
    if type(value) is dict or type(value) is OrderedDict:
        return type(value)((k, realize(v)) for k, v in value.items())
    if type(value) is list:
        return [realize(v) for v in value]
    if type(value) is tuple:
        return tuple(realize(v) for v in value)
    return value  # plain values, torch's own objects, other containers


def _realize_inert(value: Any) -> Any:
    """torch.device and layouts become torch's objects; other stand-ins keep their class with
    realized state (a DeepSpeed loss scaler holding a dtype, ...)."""
    qualname = qualname_of(value)
    args = value.__dict__.get("_args", ())
    if qualname == "torch.device":
        import torch

        return torch.device(*args)
    if qualname == "torch.serialization._get_layout":
        import torch

        return getattr(torch, str(args[0]).removeprefix("torch."))
    copy = type(value).__new__(type(value))
    copy.__dict__.update({k: realize(v) for k, v in value.__dict__.items()})
    return copy
