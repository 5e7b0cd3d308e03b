"""How DeepSpeed's AutoTP cuts a dimension over tp ranks, so that a checkpoint written at a new tp
holds exactly the slices AutoTP gives the model built at that tp (else `load_state_dict` refuses
the shapes, or worse, a near miss would load into the wrong rows).

The rule is DeepSpeed 0.19.8's `deepspeed/module_inject/tp_shard.py` (`get_shard_size`,
`get_shard_size_list`), restated here so that no checkpoint read needs DeepSpeed installed:

- a layer whose name contains none of "mlp" and the MoE MLP names (`gate_proj`, `up_proj`,
  `down_proj`, `w1`, `w2`, `w3`), is not exactly `lm_head` or `embed_out`, and whose size the
  model's key/value head count divides, is cut by heads: rank r gets `kv // tp` heads, one more
  when r < `kv % tp`;
- any other, at least `tp_grain_size` long: cut in grains, rank r gets `grains // tp` of them
  (one more when r < `grains % tp`), the last rank also the tail `size % tp_grain_size`;
- shorter than a grain: near-even, the first `size % tp` ranks one longer.

`layer_name` gives the name AutoTP's training path passes for a parameter (the one its
shard-size calls see, as recorded in fixtures/data/ds_tp_uneven/*/fixture.json: the module's full
name, "model.layers.0.self_attn.q_proj", "lm_head").
"""

from __future__ import annotations

from dataclasses import dataclass

LAST_LINEAR = ("lm_head", "embed_out")
MOE_MLP = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


@dataclass(frozen=True)
class AutoTpValues:
    """The model values AutoTP's rule reads, and where each came from (for error sentences)."""

    kv_heads: int | None = None
    kv_heads_from: str = "nothing"
    grain: int = 1
    grain_from: str = "DeepSpeed's default"


def layer_name(param: str) -> str:
    """The layer name AutoTP's training path passes to its shard-size rule for parameter `param`:
    the module's full name ("model.layers.0.mlp.up_proj.weight" -> "model.layers.0.mlp.up_proj",
    "lm_head.weight" -> "lm_head")."""
    return param.rsplit(".", 1)[0] if "." in param else param


def cut_by_heads(name: str, size: int, kv_heads: int | None) -> bool:
    """Whether AutoTP cuts this layer's dimension of `size` by key/value heads."""
    if kv_heads is None or kv_heads <= 0 or size % kv_heads:
        return False
    return "mlp" not in name and name not in LAST_LINEAR and not any(s in name for s in MOE_MLP)


def shard_size(size: int, tp: int, rank: int, name: str, kv_heads: int | None, grain: int = 1) -> int:
    """Rank `rank`'s share of a dimension of `size` cut over `tp` ranks, as AutoTP's get_shard_size."""
    if cut_by_heads(name, size, kv_heads):
        assert kv_heads is not None
        mine = kv_heads // tp + (1 if rank < kv_heads % tp else 0)
        return size * mine // kv_heads
    if size >= grain:
        grains, tail = divmod(size, grain)
        share = (grains // tp + (1 if rank < grains % tp else 0)) * grain
        return share + tail if rank == tp - 1 else share
    return size // tp + (1 if rank < size % tp else 0)


def shard_sizes(size: int, tp: int, name: str, kv_heads: int | None, grain: int = 1) -> tuple[int, ...]:
    """Every rank's share, in rank order (AutoTP's get_shard_size_list); they add up to `size`."""
    return tuple(shard_size(size, tp, r, name, kv_heads, grain) for r in range(tp))


def kv_heads_of(config: dict) -> int | None:
    """The key/value head count of a Hugging Face config.json, probed as AutoTPMeta does (its
    text_config first when it has one; num_attention_heads and the like last: kv == q heads)."""
    found = kv_heads_entry(config)
    return found[1] if found is not None and is_count(found[1]) else None


def kv_heads_entry(config: dict) -> tuple[str, object] | None:
    """(key, value) of the first head-count key config.json sets, as AutoTPMeta probes them."""
    text = config.get("text_config")
    if isinstance(text, dict):
        config = text
    for key in KV_HEAD_KEYS:
        if config.get(key) is not None:
            return key, config[key]
    return None


def is_count(value: object) -> bool:
    """A positive whole number (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


KV_HEAD_KEYS = (
    "num_key_value_heads",
    "num_kv_heads",
    "multi_query_group_num",
    "n_head_kv",
    "kv_n_heads",
    "num_attention_heads",
    "n_heads",
    "attention_heads",
)
