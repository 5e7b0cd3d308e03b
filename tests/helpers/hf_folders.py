"""Tiny Hugging Face model folders written by transformers' own save_pretrained, for convert's tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def llama_folder(path: Path, tie: bool = True, seed: int = 0) -> Path:
    """A 2-layer Llama saved by save_pretrained (tied: no lm_head.weight in model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def gpt2_folder(path: Path, seed: int = 0) -> Path:
    """A 2-layer GPT-2 (tied by its config class's default) saved by save_pretrained."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0)
    ).save_pretrained(path)
    return path


def edit_config(folder: Path, **changes) -> None:
    """Set (or, with None, remove) config.json keys, as another writer of the folder might have."""
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
