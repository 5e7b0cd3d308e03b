"""Backend conversion: any training checkpoint -> one canonical training state -> any backend.

The names below are all this package needs at import time (the command line builds its options
from them without importing torch)."""

TARGETS = ("dcp", "zero1", "zero2", "zero3", "torch", "safetensors")
SOURCES = ("dcp", "deepspeed", "torch", "safetensors")
