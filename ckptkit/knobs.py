"""Every tunable in one place (overridable per call; env vars for quick experiments)."""
from __future__ import annotations

import os

# Peak bytes of tensor data held in flight by an executor (all threads together). The built-in
# default and the variable that overrides it are named apart so help text can say both without
# showing a value the environment of one run chose.
DEFAULT_MEMORY_BUDGET = 512 * 1024 * 1024
MEMORY_BUDGET_ENV = "CKPTKIT_MEMORY_BUDGET"
MEMORY_BUDGET = int(os.environ.get(MEMORY_BUDGET_ENV, DEFAULT_MEMORY_BUDGET))
# Worker threads for reading/writing (IO-bound; copies release the GIL).
DEFAULT_WORKERS = 4
WORKERS_ENV = "CKPTKIT_WORKERS"
WORKERS = int(os.environ.get(WORKERS_ENV, DEFAULT_WORKERS))
# Default --max-shard-size for safetensors output.
MAX_SHARD_SIZE = "5GB"


def slab_bytes(budget: int | None = None, workers: int | None = None) -> int:
    """Bytes one worker may hold for one slab: the budget shared by workers, with room for a
    source read and a target buffer each."""
    budget = budget or MEMORY_BUDGET
    workers = workers or WORKERS
    return max(1 << 20, budget // (2 * max(1, workers)))


def parse_size(text: str | int, what: str | None = None) -> int:
    """'5GB', '500MB', '1GiB', '123' -> bytes (decimal units as Hugging Face uses them). `what`
    names the option the text came from, for the error."""
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
    raise UsageError(f"{what + ': ' if what else ''}cannot read size {text!r} (use e.g. 5GB, 500MB, 2GiB)")

# ---- the restricted unpickler (ckptkit.safeload): what one pickle may build ------------------------
# Measured on a DCP .metadata of 100k tensors written by torch's dcp.save (23.6 MB): 2.6M objects
# plus 2.6M memo entries, 0.8M values reached again through shared parts, nested 11 deep. A DeepSpeed
# ZeRO-3 optimizer file of 20k parameters holds lists of 20k ints (a few thousand objects).
# Objects: containers, strings and rebuilt values created, plus memo entries (each costs 50-150
# bytes: the limit bounds a small pickle's memory to about 1.5 GB); a pickle larger than 4 bytes
# per object may create one object per 4 bytes (a DCP .metadata of 600k chunks is about 140 MB).
MAX_PICKLE_OBJECTS = int(os.environ.get("CKPTKIT_MAX_PICKLE_OBJECTS", 10_000_000))
# Nesting depth of containers (ckptkit walks loaded values recursively: keep well under Python's
# recursion limit of 1000 frames).
MAX_PICKLE_DEPTH = int(os.environ.get("CKPTKIT_MAX_PICKLE_DEPTH", 100))
# Expanded size beyond the pickle itself: the values a full walk of the result visits again because
# a shared sub-object counts each time it is reached (text and byte strings weigh one per 64 bytes).
MAX_PICKLE_EXPANDED = int(os.environ.get("CKPTKIT_MAX_PICKLE_EXPANDED", 20_000_000))
# The largest single byte string or text a pickle may hold or build.
MAX_PICKLE_BLOB = int(os.environ.get("CKPTKIT_MAX_PICKLE_BLOB", 256 << 20))
# Bytes one pickle's rebuild calls may create beyond its own input (bytearray(n), tensors loaded
# whole, numpy arrays).
MAX_PICKLE_BUILT = int(os.environ.get("CKPTKIT_MAX_PICKLE_BUILT", 256 << 20))
# Wall-clock time one pickle may take: this many seconds plus one per MB of pickle (a last line
# against work that grows faster than the input, e.g. dictionary keys crafted to collide).
MAX_PICKLE_SECONDS = float(os.environ.get("CKPTKIT_MAX_PICKLE_SECONDS", 30.0))
# JSON read from a checkpoint or given as a config: nesting depth (safetensors headers, index files,
# metadata values, DeepSpeed configs are a few levels deep).
MAX_JSON_DEPTH = int(os.environ.get("CKPTKIT_MAX_JSON_DEPTH", 64))

# ---- the command line ------------------------------------------------------------------------------
# Seconds between two plain progress lines when stderr is not a terminal (CI logs).
PROGRESS_INTERVAL = float(os.environ.get("CKPTKIT_PROGRESS_INTERVAL", 5.0))
