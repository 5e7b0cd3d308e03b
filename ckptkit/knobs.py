"""Every tunable in one place (overridable per call; env vars for quick experiments)."""
from __future__ import annotations

import os

# Peak bytes of tensor data held in flight by an executor (all threads together).
MEMORY_BUDGET = int(os.environ.get("CKPTKIT_MEMORY_BUDGET", 512 * 1024 * 1024))
# Worker threads for reading/writing (IO-bound; copies release the GIL).
WORKERS = int(os.environ.get("CKPTKIT_WORKERS", 4))
# Default --max-shard-size for safetensors output.
MAX_SHARD_SIZE = "5GB"


def slab_bytes(budget: int | None = None, workers: int | None = None) -> int:
    """Bytes one worker may hold for one slab: the budget shared by workers, with room for a
    source read and a target buffer each."""
    budget = budget or MEMORY_BUDGET
    workers = workers or WORKERS
    return max(1 << 20, budget // (2 * max(1, workers)))


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '1GiB', '123' -> bytes (decimal units as Hugging Face uses them)."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 10**3, "M": 10**6, "G": 10**9, "B": 1}
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            number = t[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value <= 0:
                break
            return int(value * units[unit])
    try:
        value = int(t)
        if value > 0:
            return value
    except ValueError:
        pass
    from .errors import UsageError
    raise UsageError(f"cannot read size {text!r} (use e.g. 5GB, 500MB, 2GiB)")
