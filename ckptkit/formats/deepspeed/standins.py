"""DeepSpeed's small pickled classes as inert stand-ins: readable without deepspeed installed,
re-emitted by the writer as the original classes (ckptkit.repickle)."""

from __future__ import annotations

from typing import Any

from ...safeload import Inert, inert_class, register_allowed

CLASSES = [
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    # the enums Megatron-DeepSpeed's parsed arguments (`args` in its model-states files) hold
    ("megatron.model.enums", "PositionEmbeddingType"),
    ("megatron.model.enums", "AttnMaskType"),
    ("megatron.model.enums", "AttnType"),
    ("megatron.model.enums", "LayerType"),
]
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"

for _module, _name in CLASSES:
    register_allowed(_module, _name, inert_class(f"{_module}.{_name}"))


def enum_value(value: Any) -> Any:
    """The value of a pickled Enum member (ZeroStageEnum(3) -> 3); plain values pass through."""
    if isinstance(value, Inert):
        args = value.__dict__.get("_args", ())
        return args[0] if args else value.__dict__.get("_value_")
    return value
