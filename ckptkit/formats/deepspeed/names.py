"""DeepSpeed's file names, spelled and parsed in one place.

Every other module in ckptkit asks here for a DeepSpeed file name (to write one, to name one in a
message) or for the pattern that recognises one, so a naming variant (the `bf16_` prefix,
Megatron's `-model_TT`, expert files with or without `layer_L_`) is taught once.

  latest                                         the tag (folder) of the newest save
  mp_rank_XX_model_states.pt                     model states of model-parallel rank XX
  zero_pp_rank_D_mp_rank_XX_model_states.pt      ZeRO-3: dp rank D's model states
  [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt   dp rank D's optimizer partition
  [layer_L_]expert_G_mp_rank_XX_model_states.pt  MoE expert G (of MoE layer L) on mp rank XX
  layer_LL[-model_TT]-model_states.pt            a PipelineModule layer (on tp rank TT)
  zero_to_fp32.py, zero_to_torch.py              the recovery scripts DeepSpeed copies beside a save

The other modules' docstrings draw layouts with the builders below (`model_file(t)`,
`optim_file(d, bf16, mp=t)`, `expert_file(L, G, t)`, `layer_file(XX, TT)`), not the spelled names.
"""

from __future__ import annotations

import re

LATEST = "latest"
MAX_LATEST_BYTES = 1024  # `latest` holds one tag (a folder name: 255 bytes on most filesystems)
BF16_PREFIX = "bf16_"
OFFLOADED_TENSORS = "offloaded_tensors"  # NVMe-offloaded optimizer state (not read)
ANY_MODEL_FILE = "*_model_states.pt"  # any model-states file, in messages
ANY_OPTIM_FILE = "*_optim_states.pt"
HELPER_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies them next to every save

MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")  # (dp rank, mp rank)
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")  # (prefix, dp, mp)
EXPERT = re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_(\d+)_model_states\.pt$")  # (mp rank)
EXPERT_ID = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_\d+_model_states\.pt$")  # (layer, expert)
EXPERT_FILE = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")  # (layer, expert, mp)
STEP_TAG = re.compile(r"^global_step(\d+)$")  # (step)
LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")  # (layer, tp rank)


def step_tag(step: int) -> str:
    """`global_stepN`, the tag engine.save_checkpoint gives a save by default."""
    return f"global_step{step}"


def parse_step_tag(name: str) -> int | None:
    """The step of a `global_stepN` tag (engine.save_checkpoint's default), else None."""
    m = STEP_TAG.match(name)
    return int(m.group(1)) if m else None


def mp_rank(mp: int | str) -> str:
    """`mp_rank_XX`, the part of a name that says its model-parallel rank (a placeholder string kept)."""
    return f"mp_rank_{mp:02d}" if isinstance(mp, int) else f"mp_rank_{mp}"


def model_file(mp: int | str = 0) -> str:
    """Model-parallel rank `mp`'s model-states file (module weights, param_shapes, ...)."""
    return f"{mp_rank(mp)}_model_states.pt"


def zero_model_file(rank: int | str, mp: int | str = 0) -> str:
    """ZeRO-3's per-rank model-states file of dp rank `rank` on model-parallel rank `mp`."""
    return f"zero_pp_rank_{rank}_{mp_rank(mp)}_model_states.pt"


def optim_file(rank: int | str, bf16_prefix: bool = False, mp: int | str = 0) -> str:
    """The name DeepSpeed gives rank `rank`'s optim-states file of model-parallel rank `mp`."""
    return f"{BF16_PREFIX if bf16_prefix else ''}zero_pp_rank_{rank}_{mp_rank(mp)}_optim_states.pt"


def expert_file(layer: int | str | None, expert: int | str, mp: int | str = 0) -> str:
    """MoE expert `expert`'s file (of MoE layer `layer`; None: DeepSpeed's old layer-less name)."""
    lead = f"layer_{layer}_" if layer is not None else ""
    return f"{lead}expert_{expert}_{mp_rank(mp)}_model_states.pt"


def tp_suffix(tp_rank: int | str) -> str:
    """`-model_TT`, the part of a layer file's name that says its tensor-parallel rank."""
    return f"-model_{tp_rank:02d}" if isinstance(tp_rank, int) else f"-model_{tp_rank}"


def layer_file(layer: int | str, tp_rank: int | str | None = None) -> str:
    """A PipelineModule layer's file; `-model_TT` when the topology has a model (tensor) axis."""
    model = tp_suffix(tp_rank) if tp_rank is not None else ""
    return (
        f"layer_{layer:02d}{model}-model_states.pt"
        if isinstance(layer, int)
        else f"layer_{layer}{model}-model_states.pt"
    )


def parse_model_file(name: str) -> tuple[int, int] | None:
    """(dp rank, mp rank) of a model-states file (dp rank 0 for `mp_rank_XX_model_states.pt`), else None."""
    m = MODEL_STATES.match(name)
    return (int(m.group(1) or 0), int(m.group(2))) if m else None


def parse_optim_file(name: str) -> tuple[bool, int, int] | None:
    """(bf16 prefix, dp rank, mp rank) of an optim-states file, else None."""
    m = OPTIM_STATES.match(name)
    return (bool(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def parse_expert_file(name: str) -> tuple[str | None, str, int] | None:
    """(layer id or None, expert id, mp rank) of an expert file, as spelled (ids stay strings), else None."""
    m = EXPERT_FILE.match(name)
    return (m.group(1), m.group(2), int(m.group(3))) if m else None


def parse_layer_file(name: str) -> tuple[int, int | None] | None:
    """(layer, tp rank or None) of a PipelineModule layer file, else None."""
    m = LAYER_FILE.match(name)
    return (int(m.group(1)), int(m.group(2)) if m.group(2) is not None else None) if m else None


def looks_like_tag_folder(names: list[str]) -> bool:
    """A folder listing with both model-states and optim-states files: a tag folder."""
    return any(MODEL_STATES.match(n) for n in names) and any(OPTIM_STATES.match(n) for n in names)
