"""Per-rank random number generator state for the Checkpointer: python `random`, numpy's global
generator, torch's CPU generator and, once CUDA is in use, the current CUDA device's.

Each rank writes its own `rng/rank_<r>.json` into the step folder (JSON, never a pickle: a
checkpoint's RNG file is read without running code). Restoring puts a rank's generators back
exactly as they were at save, so the next random draws are the ones an uninterrupted run would
have made. That holds only for the same world size: the Checkpointer skips RNG restoring (with
an RngNotRestoredWarning) when the size changed, since the ranks' streams no longer correspond.
"""

from __future__ import annotations

import json
import os
import random
import stat
from typing import Any

from ..errors import FormatError, quote

FOLDER = "rng"
MAX_BYTES = 1 << 20
VERSION = 1


class RngNotRestoredWarning(UserWarning):
    """restore() left the random generators as they were (another world size, or no RNG saved)."""


def file_name(rank: int) -> str:
    return f"{FOLDER}/rank_{rank:05d}.json"


def capture(world_size: int, rank: int) -> dict:
    """This rank's generator states, as JSON-ready values (taken at the call, also for async saves)."""
    import torch

    version, words, gauss = random.getstate()
    doc: dict[str, Any] = {
        "version": VERSION,
        "world_size": world_size,
        "rank": rank,
        "python": {"version": version, "state": list(words), "gauss": gauss},
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
    }
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch
        np = None
    if np is not None:
        st = np.random.get_state(legacy=False)
        doc["numpy"] = {
            "bit_generator": st["bit_generator"],
            "key": [int(k) for k in st["state"]["key"]],
            "pos": int(st["state"]["pos"]),
            "has_gauss": int(st["has_gauss"]),
            "gauss": float(st["gauss"]),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        doc["cuda"] = {
            "device": torch.cuda.current_device(),
            "state": torch.cuda.get_rng_state().numpy().tobytes().hex(),
        }
    return doc


def write(folder: str, doc: dict) -> None:
    """Write this rank's file into `folder` (the step's temporary), fsynced."""
    path = os.path.join(folder, file_name(doc["rank"]))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())


def read(folder: str, rank: int) -> dict | None:
    """This rank's saved states, or None when the step has none (saved with rng=False, or by an
    older ckptkit). A file that is there but unusable is an error naming it."""
    path = os.path.join(folder, file_name(rank))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FormatError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            raise FormatError(f"{path}: is not a regular file of at most {MAX_BYTES} bytes")
        raw = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw.decode("utf-8"))
        _check(doc, rank)
    except (
        ValueError,
        UnicodeDecodeError,
        TypeError,
        KeyError,
        IndexError,
        OverflowError,
        RuntimeError,
        RecursionError,
    ) as exc:  # what json and the generators' own setters raise for a bad state
        raise FormatError(f"{path}: is not a ckptkit RNG state ({quote(str(exc)[:120])})") from None
    return doc


def _check(doc: Any, rank: int) -> None:
    """Raise unless every state in `doc` is one its generator takes back: each is set on a
    throwaway generator first, so apply() never fails half-way with the generators half replaced."""
    if not isinstance(doc, dict) or doc.get("version") != VERSION or doc.get("rank") != rank:
        raise ValueError(f"version {VERSION} and rank {rank} expected")
    world = doc.get("world_size")
    if type(world) is not int or not rank < world:
        raise ValueError(f"world_size is not an int above rank {rank}")
    import torch

    random.Random().setstate(_python_state(doc["python"]))
    torch.Generator().set_state(_byte_tensor(doc["torch"]))
    if "numpy" in doc:
        import numpy as np

        np.random.RandomState().set_state(_numpy_state(doc["numpy"]))
    if "cuda" in doc:
        cuda = doc["cuda"]
        if not isinstance(cuda, dict) or type(cuda.get("device")) is not int:
            raise ValueError("cuda is not a device and a state")
        state = _byte_tensor(cuda["state"])
        if torch.cuda.is_available():  # apply() sets it only then
            torch.Generator(device="cuda").set_state(state)


def _python_state(py: Any) -> tuple:
    """What random.setstate takes; its words are checked by the setter (and need 32 bits)."""
    if not isinstance(py, dict) or type(py.get("version")) is not int:
        raise ValueError("python is not a version, state and gauss")
    words, gauss = py["state"], py["gauss"]
    if not (isinstance(words, list) and all(type(w) is int for w in words)):
        raise ValueError("python state is not a list of ints")
    if gauss is not None and type(gauss) is not float:
        raise ValueError("python gauss is neither null nor a float")
    return py["version"], tuple(words), gauss


def _numpy_state(n: Any) -> dict:
    """What np.random.set_state takes. numpy accepts any position, also outside its 624-word key,
    and then reads past it: the position is checked here."""
    import numpy as np

    if not isinstance(n, dict) or not isinstance(n.get("bit_generator"), str):
        raise ValueError("numpy is not a generator state")
    key, pos = n["key"], n["pos"]
    if not (isinstance(key, list) and all(type(k) is int for k in key)):
        raise ValueError("numpy key is not a list of ints")
    if type(pos) is not int or not 0 <= pos <= len(key):
        raise ValueError(f"numpy pos is not a position in its key of {len(key)} words")
    if n["has_gauss"] not in (0, 1) or type(n["has_gauss"]) is not int or type(n["gauss"]) is not float:
        raise ValueError("numpy has_gauss is not 0 or 1 with a float gauss")
    return {
        "bit_generator": n["bit_generator"],
        "state": {"key": np.array(key, dtype=np.uint32), "pos": pos},
        "has_gauss": n["has_gauss"],
        "gauss": n["gauss"],
    }


def apply(doc: dict) -> None:
    """Put the generators back as `doc` records them (CUDA only where CUDA is available). `doc`
    comes from read(), which has tried every state on a throwaway generator."""
    import torch

    random.setstate(_python_state(doc["python"]))
    torch.set_rng_state(_byte_tensor(doc["torch"]))
    if "numpy" in doc:
        import numpy as np

        np.random.set_state(_numpy_state(doc["numpy"]))
    if "cuda" in doc and torch.cuda.is_available():
        torch.cuda.set_rng_state(_byte_tensor(doc["cuda"]["state"]))


def _byte_tensor(hexed: Any) -> Any:
    import torch

    if not isinstance(hexed, str):
        raise ValueError("a generator state is not a hex string")
    return torch.frombuffer(bytearray(bytes.fromhex(hexed)), dtype=torch.uint8)
