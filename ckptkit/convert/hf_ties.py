"""Weight ties an HF model folder records only in its config.json.

`save_pretrained` leaves a tied name out of the weights files (`lm_head.weight` of a model with
`tie_word_embeddings: true` is the input embedding, saved once), and transformers ties it again
when the model is built. A loader that takes the state dict as it is (FSDP2's `dcp.load` +
`set_state_dict`, `load_state_dict` of a torch.save file, DeepSpeed) asks for both names, so
convert writes the tied name as the view of its owner, as `model.state_dict()` lists it.

The rule, without importing the model class (its `_tied_weights_keys` are not on disk):

- the flag is transformers' own: config.json's `tie_word_embeddings`, else the one in its
  `text_config` (composite models), else the default of the config class of its `model_type`
  (transformers' defaults differ per model: true for GPT-2, false for Llama);
- the pairs are the `_tied_weights_keys` of the class config.json's `architectures` names, from
  the table ckptkit/convert/hf_ties.json (written by scripts/generate_hf_ties.py from the
  installed transformers; classes whose keys are patterns are not in it);
- a pair is honoured when its tied name is missing from the source and its owner is present with
  the same shape. An architecture outside the table, a flag that cannot be known, or transformers
  4's `tie_encoder_decoder` are said in a note, never guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from ..errors import CkptkitError, FormatError
from ..index.types import TensorEntry

CONFIG = "config.json"
MAX_CONFIG_BYTES = 16 << 20
FLAG = "tie_word_embeddings"
SOURCE_FORMATS = ("safetensors", "torch_save")  # what save_pretrained writes (DCP/DeepSpeed list both names)


@dataclass
class ConfigTies:
    """The ties taken from config.json (alias -> owner, the source's names), and what was not taken."""

    ties: dict[str, str] = field(default_factory=dict)
    why: str = ""  # e.g. "config.json's tie_word_embeddings"
    notes: list[str] = field(default_factory=list)


@lru_cache(maxsize=1)
def table() -> dict:
    """The architectures' tie pairs and the model types' default flag (transformers' own)."""
    from ..safe_json import loads

    return loads(resources.files(__package__).joinpath("hf_ties.json").read_text(), "ckptkit/convert/hf_ties.json")


def source_config(path: str, fmt: str, follow_links: bool | None = None) -> dict | None:
    """config.json of the folder holding the checkpoint at `path` (a file's own folder), for the
    formats save_pretrained writes; None for any other source or when there is none."""
    if fmt not in SOURCE_FORMATS:
        return None
    return read_config(_folder_of(path, follow_links), follow_links)


def _folder_of(path: str, follow_links: bool | None) -> str:
    """The checkpoint's folder: `path` itself, or a single file's own folder."""
    from ..storage.source import is_url, open_source

    if is_url(path):
        return path.rstrip("/") if open_source(path, follow_links).isdir("") else path.rstrip("/").rpartition("/")[0]
    return path.rstrip("/") if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def read_config(folder: str, follow_links: bool | None = None) -> dict | None:
    """config.json of `folder` as a JSON object, None when there is none; bounded and checked."""
    from ..storage.source import open_source

    try:
        source = open_source(folder, follow_links)
        if CONFIG not in source.listdir(""):
            return None
    except (CkptkitError, OSError):
        return None
    return model_config(source)


def model_config(source, name: str = CONFIG) -> dict:
    """The model config `name` of `source` (a storage Source) as a JSON object: its size and
    values bounded before parsing; a FIFO, a link leading out, an oversize file or no object is
    one sentence."""
    from ..safe_json import loads

    size = source.size(name)
    if size > MAX_CONFIG_BYTES:
        raise FormatError(
            f"{source.label(name)}: is {size:,} bytes, more than a model config ({MAX_CONFIG_BYTES:,} at most)"
        )
    doc = loads(source.read(name, 0, size), source.label(name), "the model config", bounded=True)
    if not isinstance(doc, dict):
        raise FormatError(f"{source.label(name)}: is not a JSON object (a model config is one)")
    return doc


def tie_flag(config: dict) -> tuple[bool | None, str]:
    """(whether transformers ties the word embeddings, where that was read); None: unknown."""
    if isinstance(config.get(FLAG), bool):
        return config[FLAG], f"config.json's {FLAG}"
    text = config.get("text_config")
    if isinstance(text, dict) and isinstance(text.get(FLAG), bool):
        return text[FLAG], f"config.json's text_config.{FLAG}"
    model_type = config.get("model_type")
    default = table()["defaults"].get(model_type) if isinstance(model_type, str) else None
    if isinstance(default, bool):
        return default, f"the {FLAG} default of model_type {model_type!r} (config.json does not set it)"
    return None, ""


def config_ties(config: dict | None, model: dict[str, TensorEntry]) -> ConfigTies:
    """The ties `config` records that `model` (the source's tensors by name) lacks."""
    found = ConfigTies()
    if config is None:
        return found
    if config.get("tie_encoder_decoder") is True:
        found.notes.append(
            "config.json sets tie_encoder_decoder (transformers 4); those ties are not added: "
            "the encoder's names depend on the model class"
        )
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    pairs = next((table()["pairs"][a] for a in archs if a in table()["pairs"]), None)
    flag, why = tie_flag(config)
    if pairs is None:
        if flag and archs:
            found.notes.append(
                f"{why} ties the word embeddings, but ckptkit does not know which tensors "
                f"{archs[0]} ties (not in ckptkit/convert/hf_ties.json): no tied name added"
            )
        return found
    wanted = {alias: owner for alias, owner in pairs.items() if alias not in model and owner in model}
    if not wanted:
        return found
    if flag is None:
        found.notes.append(
            f"config.json does not say whether {archs[0]} ties its word embeddings "
            f"({FLAG}) and its model_type is unknown: {', '.join(sorted(wanted))} not added"
        )
    elif flag:
        found.ties, found.why = wanted, why
    return found


__all__ = ["ConfigTies", "config_ties", "read_config", "source_config", "tie_flag", "table"]
