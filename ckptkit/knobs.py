"""Every tunable in one place (overridable per call; env vars for quick experiments).

The knobs an environment variable overrides (CKPTKIT_MEMORY_BUDGET, CKPTKIT_WORKERS, the pickle and
JSON limits, CKPTKIT_PROGRESS_INTERVAL, CKPTKIT_DIST_TIMEOUT) are read when first used, not at
import: importing ckptkit never fails because of the environment. A value that is no value of the
knob is refused with a UsageError naming the variable, its value and what it takes (the command
line checks them all before it starts: knobs.check_environment). Each is read once; assigning the
module attribute (a test, a caller) overrides it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import UsageError, quote

# Peak bytes of tensor data held in flight by an executor (all threads together). The built-in
# default and the variable that overrides it are named apart so help text can say both without
# showing a value the environment of one run chose.
DEFAULT_MEMORY_BUDGET = 512 * 1024 * 1024
MEMORY_BUDGET_ENV = "CKPTKIT_MEMORY_BUDGET"
MEMORY_BUDGET: int  # read from MEMORY_BUDGET_ENV when first used (see KNOBS)
# Worker threads for reading/writing (IO-bound; copies release the GIL); the range --workers takes.
DEFAULT_WORKERS = 4
WORKERS_ENV = "CKPTKIT_WORKERS"
MIN_WORKERS, MAX_WORKERS = 1, 64
WORKERS: int
# Default --max-shard-size for safetensors output.
MAX_SHARD_SIZE = "5GB"
# The largest size parse_size takes: more bytes than any file or memory holds (and than an int64).
MAX_SIZE_BYTES = (1 << 63) - 1
SIZE_EXAMPLES = "e.g. 5GB, 500MB, 2GiB"


def slab_bytes(budget: int | None = None, workers: int | None = None) -> int:
    """Bytes one worker may hold for one slab: the budget shared by workers, with room for a
    source read and a target buffer each."""
    budget = budget or value_of("MEMORY_BUDGET")
    workers = workers or value_of("WORKERS")
    return max(1 << 20, budget // (2 * max(1, workers)))


_UNITS = {
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "B": 1,
}


def parse_size(text: str | int, what: str | None = None) -> int:
    """'5GB', '500MB', '1GiB', '123' -> bytes (decimal units as Hugging Face uses them). `what`
    names the option the text came from, for the error. A size is a whole number of bytes from 1
    to MAX_SIZE_BYTES: NaN, infinite, too large or rounding down to 0 bytes is refused."""
    nbytes, problem = _size_bytes(text)
    if problem:
        raise UsageError(f"{what + ': ' if what else ''}{problem}")
    return nbytes


def _size_bytes(text: str | int) -> tuple[int, str]:
    """(bytes, "") for a size, else (0, the sentence saying why it is none)."""
    shown = quote(str(text))
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        return 0, f"cannot read size {shown} (use {SIZE_EXAMPLES})"
    if isinstance(text, int):
        value: float | int = text
    else:
        value = _size_value(text)
        if value is None:
            return 0, f"cannot read size {shown} (use {SIZE_EXAMPLES})"
    if isinstance(value, float) and not math.isfinite(value):
        return 0, f"size {shown} is no number of bytes (use {SIZE_EXAMPLES})"
    if value > MAX_SIZE_BYTES:
        return 0, f"size {shown} is larger than any file (at most {MAX_SIZE_BYTES} bytes)"
    if int(value) < 1:
        return 0, f"size {shown} is less than one byte (a size is at least 1 byte: use {SIZE_EXAMPLES})"
    return int(value), ""


def _size_value(text: str) -> float | int | None:
    """The bytes `text` spells (a float once a unit multiplies it), or None when it spells none."""
    t = text.strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                return float(t[: -len(unit)]) * _UNITS[unit]
            except ValueError:
                return None
    try:
        return int(t)
    except ValueError:
        return None


# ---- the restricted unpickler (ckptkit.safeload): what one pickle may build ------------------------
# Measured on a DCP .metadata of 100k tensors written by torch's dcp.save (23.6 MB): 2.6M objects
# plus 2.6M memo entries, 0.8M values reached again through shared parts, nested 11 deep. A DeepSpeed
# ZeRO-3 optimizer file of 20k parameters holds lists of 20k ints (a few thousand objects).
# Objects: containers, strings and rebuilt values created, plus memo entries (each costs 50-150
# bytes: the limit bounds a small pickle's memory to about 1.5 GB); a pickle larger than 4 bytes
# per object may create one object per 4 bytes (a DCP .metadata of 600k chunks is about 140 MB).
MAX_PICKLE_OBJECTS: int  # CKPTKIT_MAX_PICKLE_OBJECTS, default 10_000_000
# Nesting depth of containers (ckptkit walks loaded values recursively: keep well under Python's
# recursion limit of 1000 frames, hence at most 500).
MAX_PICKLE_DEPTH: int  # CKPTKIT_MAX_PICKLE_DEPTH, default 100
# Expanded size beyond the pickle itself: the values a full walk of the result visits again because
# a shared sub-object counts each time it is reached (text and byte strings weigh one per 64 bytes).
MAX_PICKLE_EXPANDED: int  # CKPTKIT_MAX_PICKLE_EXPANDED, default 20_000_000
# The largest single byte string or text a pickle may hold or build.
MAX_PICKLE_BLOB: int  # CKPTKIT_MAX_PICKLE_BLOB (a size), default 256 MiB
# Bytes one pickle's rebuild calls may create beyond its own input (bytearray(n), tensors loaded
# whole, numpy arrays).
MAX_PICKLE_BUILT: int  # CKPTKIT_MAX_PICKLE_BUILT (a size), default 256 MiB
# Wall-clock time one pickle may take: this many seconds plus one per MB of pickle (a last line
# against work that grows faster than the input, e.g. dictionary keys crafted to collide).
MAX_PICKLE_SECONDS: float  # CKPTKIT_MAX_PICKLE_SECONDS, default 30
# JSON read from a checkpoint or given as a config: nesting depth (safetensors headers, index files,
# metadata values, DeepSpeed configs are a few levels deep).
MAX_JSON_DEPTH: int  # CKPTKIT_MAX_JSON_DEPTH, default 64

# ---- the command line and the torchrun job ---------------------------------------------------------
# Seconds between two plain progress lines when stderr is not a terminal (CI logs).
PROGRESS_INTERVAL: float  # CKPTKIT_PROGRESS_INTERVAL, default 5
# Seconds a rank of a torchrun job waits on the others (the process group's timeout).
DIST_TIMEOUT: float  # CKPTKIT_DIST_TIMEOUT, default 600


# ---- knobs the environment overrides ---------------------------------------------------------------


def _size(raw: str) -> int:
    """A size variable's bytes, by parse_size's rules (units, at least 1 byte)."""
    nbytes, problem = _size_bytes(raw)
    if problem:
        raise ValueError(problem)
    return nbytes


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """A reader of whole numbers from `low` to `high` (None: no upper bound)."""

    def read(raw: str) -> int:
        value = int(raw.strip())
        if value < low or (high is not None and value > high):
            raise ValueError(raw)
        return value

    return read


def _seconds(low_exclusive: bool) -> Callable[[str], float]:
    """A reader of finite seconds above 0 (`low_exclusive`) or from 0."""

    def read(raw: str) -> float:
        value = float(raw.strip())
        if not math.isfinite(value) or value < 0 or (low_exclusive and value == 0):
            raise ValueError(raw)
        return value

    return read


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, the built-in default, how its text reads, what it takes."""

    env: str
    default: Any
    read: Callable[[str], Any]
    expected: str

    def value(self) -> Any:
        """The variable's value read (the default when unset); UsageError when it is none."""
        raw = os.environ.get(self.env)
        if raw is None:
            return self.default
        try:
            return self.read(raw)
        except (ValueError, OverflowError):
            raise UsageError(
                f"environment variable {self.env} is {quote(raw)}: expected {self.expected}"
                f"; unset it for the default ({self.default!r})"
            ) from None


_COUNT = "a whole number of at least 1"
_BYTES = f"a size of at least 1 byte ({SIZE_EXAMPLES})"
KNOBS: dict[str, Knob] = {
    "MEMORY_BUDGET": Knob(MEMORY_BUDGET_ENV, DEFAULT_MEMORY_BUDGET, _size, _BYTES),
    "WORKERS": Knob(
        WORKERS_ENV,
        DEFAULT_WORKERS,
        _whole(MIN_WORKERS, MAX_WORKERS),
        f"a whole number from {MIN_WORKERS} to {MAX_WORKERS}, as --workers takes",
    ),
    "MAX_PICKLE_OBJECTS": Knob("CKPTKIT_MAX_PICKLE_OBJECTS", 10_000_000, _whole(1), _COUNT),
    "MAX_PICKLE_DEPTH": Knob("CKPTKIT_MAX_PICKLE_DEPTH", 100, _whole(1, 500), "a whole number from 1 to 500"),
    "MAX_PICKLE_EXPANDED": Knob("CKPTKIT_MAX_PICKLE_EXPANDED", 20_000_000, _whole(1), _COUNT),
    "MAX_PICKLE_BLOB": Knob("CKPTKIT_MAX_PICKLE_BLOB", 256 << 20, _size, _BYTES),
    "MAX_PICKLE_BUILT": Knob("CKPTKIT_MAX_PICKLE_BUILT", 256 << 20, _size, _BYTES),
    "MAX_PICKLE_SECONDS": Knob("CKPTKIT_MAX_PICKLE_SECONDS", 30.0, _seconds(True), "a number of seconds above 0"),
    "MAX_JSON_DEPTH": Knob("CKPTKIT_MAX_JSON_DEPTH", 64, _whole(1, 500), "a whole number from 1 to 500"),
    "PROGRESS_INTERVAL": Knob("CKPTKIT_PROGRESS_INTERVAL", 5.0, _seconds(False), "a number of seconds, 0 or more"),
    "DIST_TIMEOUT": Knob("CKPTKIT_DIST_TIMEOUT", 600.0, _seconds(True), "a number of seconds above 0"),
}


def value_of(name: str) -> Any:
    """Knob `name` now: the value assigned to the module attribute, else its variable's, read once."""
    if name in globals():
        return globals()[name]
    value = KNOBS[name].value()
    globals()[name] = value
    return value


def __getattr__(name: str) -> Any:
    """`knobs.WORKERS` and the others of KNOBS, read from the environment on first use (PEP 562)."""
    if name in KNOBS:
        return value_of(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_environment() -> None:
    """Read every knob now (the command line, before it starts): the first bad variable raises."""
    for name in KNOBS:
        value_of(name)
