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
    doc: dict[str, Any] = {"version": VERSION, "world_size": world_size, "rank": rank,
                           "python": {"version": version, "state": list(words), "gauss": gauss},
                           "torch": torch.get_rng_state().numpy().tobytes().hex()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch
        np = None
    if np is not None:
        st = np.random.get_state(legacy=False)
        doc["numpy"] = {"bit_generator": st["bit_generator"], "key": [int(k) for k in st["state"]["key"]],
                        "pos": int(st["state"]["pos"]), "has_gauss": int(st["has_gauss"]),
                        "gauss": float(st["gauss"])}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        doc["cuda"] = {"device": torch.cuda.current_device(),
                       "state": torch.cuda.get_rng_state().numpy().tobytes().hex()}
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
    except (ValueError, UnicodeDecodeError, TypeError, KeyError, RecursionError) as exc:
        raise FormatError(f"{path}: is not a ckptkit RNG state ({quote(str(exc)[:120])})") from None
    return doc


def _check(doc: Any, rank: int) -> None:
    if not isinstance(doc, dict) or doc.get("version") != VERSION or doc.get("rank") != rank:
        raise ValueError(f"version {VERSION} and rank {rank} expected")
    world = doc.get("world_size")
    if type(world) is not int or not rank < world:
        raise ValueError(f"world_size is not an int above rank {rank}")
    py = doc["python"]
    if not (isinstance(py["state"], list) and all(type(w) is int for w in py["state"])):
        raise ValueError("python state is not a list of ints")
    bytes.fromhex(doc["torch"])


def apply(doc: dict) -> None:
    """Put the generators back as `doc` records them (CUDA only where CUDA is available)."""
    import torch

    py = doc["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    torch.set_rng_state(_byte_tensor(doc["torch"]))
    if "numpy" in doc:
        import numpy as np

        n = doc["numpy"]
        np.random.set_state({"bit_generator": n["bit_generator"],
                             "state": {"key": np.array(n["key"], dtype=np.uint32), "pos": n["pos"]},
                             "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    if "cuda" in doc and torch.cuda.is_available():
        torch.cuda.set_rng_state(_byte_tensor(doc["cuda"]["state"]))


def _byte_tensor(hexed: str) -> Any:
    import torch

    return torch.frombuffer(bytearray(bytes.fromhex(hexed)), dtype=torch.uint8)
