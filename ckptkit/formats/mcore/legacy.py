"""Megatron-LM's legacy checkpoints (`--ckpt-format torch`): `iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt`,
one torch.save file per tensor and pipeline rank, each holding that rank's slice of the model.

Such a file alone is not the model: read as a plain torch.save file it would show half-size
`linear_qkv` / `linear_fc1` tensors as if they were whole, and consolidating it would write half
a model. The iteration folder's rank files are joined into one checkpoint (legacy_join.py); a
file whose `args` say it was saved split over tensor or pipeline ranks, opened alone (or its
rank folder), is refused in one sentence that says to open the iteration folder instead.
"""

from __future__ import annotations

import re
import struct
from ...errors import CkptkitError, UnsupportedError
from ...runner.torch_archive import ZIP_MAGIC, load_structure, open_archive
from ...storage.source import Source
from .args import MegatronArgs, megatron_args

RANK_FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"mp_rank_[0-9]{2}(?:_[0-9]{3}){0,2}")  # mp_rank_TT, mp_rank_TT_PPP, mp_rank_TT_PPP_EEE
SNIFFED_HEAD = 1 << 20  # the bytes of data.pkl looked at for Megatron's args
WHAT_TO_DO = (
    "give ckptkit the iteration folder holding every rank's mp_rank_* folder (or the save folder above it), "
    "which it reads as one checkpoint"
)


def file_args(source: Source, name: str) -> MegatronArgs | None:
    """The Megatron `args` a torch.save file holds at its top level (with `checkpoint_version` and
    a model state dict beside them), or None. Only a data.pkl that names argparse's Namespace is unpickled
    (restricted, lazily: no tensor bytes are read)."""
    data = _pickle_head(source, name)
    if data is None or b"argparse" not in data or b"Namespace" not in data or b"checkpoint_version" not in data:
        return None
    structure = load_structure(open_archive(source, name))
    if not isinstance(structure, dict) or "args" not in structure or not _holds_model(structure):
        return None
    return megatron_args(structure["args"])


def _pickle_head(source: Source, name: str) -> bytes | None:
    """The first bytes of `<folder>/data.pkl` when it is the archive's first member, stored (as
    torch.save writes it), else None: a look that costs one small read, not the archive's whole
    directory (a torch.save file of 20k tensors has 20k members). Megatron-LM pickles `args` and
    `checkpoint_version` first, so they are within this head."""
    size = source.size(name)
    if size < 30:
        return None
    head = source.read(name, 0, 30)
    if head[:4] != ZIP_MAGIC:
        return None
    _, _, method, _, _, _, _, _, name_len, extra_len = struct.unpack("<HHHHHIIIHH", head[4:30])
    member = source.read(name, 30, name_len)
    if method != 0 or not member.endswith(b"/data.pkl") or member.count(b"/") != 1:
        return None
    start = 30 + name_len + extra_len
    return source.read(name, start, max(0, min(SNIFFED_HEAD, size - start)))


def _holds_model(structure: dict) -> bool:
    """A rank's model state dict is there (`model`, or `model0`, `model1`... per virtual pipeline
    stage): not a torch_dist save's common.pt, whose model is all in the sharded files."""
    return any(isinstance(k, str) and re.fullmatch(r"model[0-9]*", k) for k in structure)


def split_file(source: Source, name: str) -> MegatronArgs | None:
    """A legacy rank file saved split over tensor or pipeline ranks (its args say so), else None."""
    try:
        args = file_args(source, name)
    except (CkptkitError, RecursionError):  # not for this check to word: the torch.save reader says it
        return None
    return args if args is not None and args.model_parallel else None


def rank_folders(source: Source, rel: str = "") -> list[str]:
    """The `mp_rank_*` folders holding a model_optim_rng.pt in the folder `rel` (an iteration folder)."""
    found = []
    for n in source.listdir(rel):
        sub = f"{rel}/{n}" if rel else n
        if RANK_DIR.fullmatch(n) and source.isdir(sub) and source.exists(f"{sub}/{RANK_FILE}"):
            found.append(n)
    return sorted(found)


def refuse_rank_file(label: str, args: MegatronArgs) -> UnsupportedError:
    return UnsupportedError(
        f"{label}: is one rank's part of a Megatron-LM checkpoint saved at {args.layout()} (its args say "
        f"tensor_model_parallel_size={args.tp}, pipeline_model_parallel_size={args.pp}), not the whole model; "
        f"{WHAT_TO_DO}"
    )
