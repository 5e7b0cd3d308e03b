"""Backend conversion: any training checkpoint -> one canonical training state -> any backend.

The names below are all this package needs at import time (the command line builds its options
from them without importing torch). `--from` and `--to` take the same names: `--to NAME` writes
that backend, `--from NAME` asserts that the detected source is it."""

# name -> the writer it selects ("zero" takes its stage from the DeepSpeed config)
TARGET_OF = {
    "dcp": "dcp",
    "fsdp": "dcp",
    "fsdp2": "dcp",  # DCP in the FSDP2 layout
    "deepspeed": "zero",
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3": "zero3",
    "torch": "torch",
    "safetensors": "safetensors",
    "hf": "safetensors",  # a safetensors folder from_pretrained loads
    "ds-universal": "ds_universal",  # DeepSpeed's universal checkpoint (ds_to_universal's layout)
}
# name -> (the index format a source of that name has, the ZeRO stage it must record or None)
SOURCE_OF = {
    "dcp": ("dcp", None),
    "fsdp": ("dcp", None),
    "fsdp2": ("dcp", None),
    "deepspeed": ("deepspeed", None),
    "zero1": ("deepspeed", 1),
    "zero2": ("deepspeed", 2),
    "zero3": ("deepspeed", 3),
    "torch": ("torch_save", None),
    "safetensors": ("safetensors", None),
    "hf": ("safetensors", None),
    "ds-universal": ("ds_universal", None),
}
NAMES = tuple(TARGET_OF)
TARGETS = NAMES  # what --to accepts
SOURCES = NAMES  # what --from accepts: the same names
