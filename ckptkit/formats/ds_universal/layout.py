"""Where the parts of a DeepSpeed universal checkpoint are: the names both its reader and its
writer use, so the two never disagree about the folder DeepSpeed's `load_universal` reads.

    <root>/latest_universal            the tag (ds_to_universal writes it beside its output)
    <root>/<tag>/mp_rank_00_model_states.pt   (ZeRO 3: zero_pp_rank_<r>_mp_rank_00_model_states.pt)
    <root>/<tag>/zero/optimizer_state.pt      ds_version, param_groups (the engine's global state)
    <root>/<tag>/zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt, step.pt
"""

from __future__ import annotations

import re

from ...errors import FormatError, quote
from ...storage.source import Source

LATEST_UNIVERSAL = "latest_universal"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
FP32 = "fp32"  # the state file of a parameter's fp32 master (DeepSpeed's FP32_WEIGHT_KEY)
STEP = "step"
PARAM = "param"  # the key of the tensor in a state file's dict (DeepSpeed's PARAM)
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")
MAX_TAG_BYTES = 4096


def join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def model_state_files(source: Source, folder: str) -> list[str]:
    """The model-states files of a tag folder: ZeRO 1/2's mp_rank file(s) when there are any
    (ckptkit writes both names), else ZeRO 3's one per dp rank, in rank order."""
    names = [n for n in source.listdir(folder) if MODEL_STATES.match(n)] if source.isdir(folder) else []
    plain = [n for n in names if n.startswith("mp_rank_")]
    return sorted(plain or names, key=lambda n: [int(x) for x in re.findall(r"\d+", n)])


def is_tag_folder(source: Source, folder: str) -> bool:
    """A folder holding zero/optimizer_state.pt and a model-states file: ds_to_universal's output."""
    zero = join(folder, ZERO)
    return (
        source.isdir(zero)
        and OPTIMIZER_STATE in source.listdir(zero)
        and not source.isdir(join(zero, OPTIMIZER_STATE))
        and bool(model_state_files(source, folder))
    )


def read_latest_universal(source: Source) -> str:
    """The tag `latest_universal` names, checked to be one folder name inside the checkpoint."""
    size = source.size(LATEST_UNIVERSAL)
    head = source.read(LATEST_UNIVERSAL, 0, min(size, MAX_TAG_BYTES + 1))
    tag = head.decode("utf-8", "replace").strip()
    label = source.label(LATEST_UNIVERSAL)
    if size > MAX_TAG_BYTES or not tag or "/" in tag or "\\" in tag or tag in (".", "..") or not tag.isprintable():
        raise FormatError(f"{label}: expected the name of a tag folder beside it, found {quote(head[:200])}")
    return tag


def tag_folder(source: Source, tag: str | None) -> str:
    """The folder (relative to the source) that holds the universal checkpoint: `tag`, the one
    `latest_universal` names, or the source itself."""
    if tag is None and is_tag_folder(source, ""):
        return ""
    if tag is None:
        tag = read_latest_universal(source)
    if not is_tag_folder(source, tag):
        raise FormatError(
            f"{source.label(tag)}: expected a universal checkpoint folder (zero/{OPTIMIZER_STATE} and "
            f"an mp_rank_*_model_states.pt file), as {LATEST_UNIVERSAL} or --tag names it"
        )
    return tag
