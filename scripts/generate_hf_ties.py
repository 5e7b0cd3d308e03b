"""Write ckptkit/convert/hf_ties.json from the installed transformers: the table convert uses to
honour the weight ties an HF folder records only in its config.json (tied names are not saved).

- "pairs": architecture (config.json's `architectures`) -> {tied name: the name it is tied to},
  the model class's own `_tied_weights_keys` where every entry is a plain parameter name (classes
  whose keys are regular expressions or module names are left out: they need the model to expand).
- "defaults": model_type -> the config class's default `tie_word_embeddings`, what transformers
  uses when config.json does not say (save_pretrained may leave a default value out).

Run with the dev environment: `.venv/bin/python scripts/generate_hf_ties.py`.
"""
from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

PLAIN = re.compile(r"^[A-Za-z0-9_.]+\.(weight|bias)$")
OUT = Path(__file__).resolve().parent.parent / "ckptkit" / "convert" / "hf_ties.json"


def _model_classes() -> set[str]:
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for attr in dir(modeling_auto):
        table = getattr(modeling_auto, attr)
        if attr.endswith("_MAPPING_NAMES") and isinstance(table, dict):
            for value in table.values():
                names.update(value if isinstance(value, (list, tuple)) else [value])
    return names


def _pairs() -> dict[str, dict[str, str]]:
    import transformers

    pairs: dict[str, dict[str, str]] = {}
    for name in sorted(_model_classes()):
        try:
            cls = getattr(transformers, name)
        except Exception:  # a class whose optional dependency is missing
            continue
        tied = getattr(cls, "_tied_weights_keys", None)
        if isinstance(tied, dict) and tied and all(PLAIN.match(k) and PLAIN.match(v) for k, v in tied.items()):
            pairs[name] = dict(sorted(tied.items()))
    return pairs


def _defaults() -> dict[str, bool]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults: dict[str, bool] = {}
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            value = getattr(CONFIG_MAPPING[model_type](), "tie_word_embeddings", None)
        except Exception:  # a config that cannot be made without arguments
            continue
        if isinstance(value, bool):
            defaults[model_type] = value
    return defaults


def _compact(table: dict) -> str:
    """One line per architecture and per model type, so a regeneration diffs line by line."""
    def block(items: dict) -> str:
        return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in items.items()) + "\n}"

    return (f'{{"transformers": {json.dumps(table["transformers"])},\n"pairs": {block(table["pairs"])},\n'
            f'"defaults": {block(table["defaults"])}}}\n')


def main() -> None:
    import transformers

    warnings.simplefilter("ignore")
    table = {"transformers": transformers.__version__, "pairs": _pairs(), "defaults": _defaults()}
    OUT.write_text(_compact(table))
    print(f"{OUT}: {len(table['pairs'])} architectures, {len(table['defaults'])} model types", file=sys.stderr)


if __name__ == "__main__":
    main()
