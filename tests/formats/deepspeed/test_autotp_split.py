"""ckptkit's restatement of AutoTP's shard-size rule gives DeepSpeed's own sizes
(deepspeed.module_inject.tp_shard.get_shard_size_list) for many sizes, tp sizes, grains, key/value
head counts and layer names, and the layer names are the ones AutoTP passes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from ckptkit.formats.deepspeed.autotp_split import kv_heads_of, layer_name, shard_sizes

ROOT = Path(__file__).resolve().parents[3]
UNEVEN = ROOT / "fixtures" / "data" / "ds_tp_uneven"

NAMES = [
    "self_attn.q_proj",
    "self_attn.o_proj",
    "attn.c_attn",
    "mlp.gate_proj",
    "mlp.dense_h_to_4h",
    "experts.w1",
    "block_sparse_moe.w2",
    "feed_forward.w3",
    "lm_head",
    ".lm_head",
    "embed_out",
    "model.embed_tokens",
    "down_proj",
]


def _deepspeed_sizes(size, tp, name, kv, grain):
    tp_shard = pytest.importorskip("deepspeed.module_inject.tp_shard")
    meta = tp_shard.AutoTPMeta(num_kv_heads=kv, tp_grain_size=grain)
    return tuple(tp_shard.get_shard_size_list(size, tp, meta, name))


@pytest.mark.parametrize("name", NAMES)
def test_shard_sizes_equal_deepspeeds_for_many_cases(name):
    cases = 0
    for size, tp, grain, kv in itertools.product(
        (1, 2, 3, 5, 7, 12, 16, 24, 37, 61, 63, 64, 100, 127, 4096, 11008, 50257),
        (1, 2, 3, 4, 5, 8),
        (1, 4, 8, 64),
        (None, 1, 2, 3, 4, 8, 32),
    ):
        try:
            want = _deepspeed_sizes(size, tp, name, kv, grain)
        except AssertionError:  # DeepSpeed's own sizes do not tile the size: not a cut it makes
            continue
        assert shard_sizes(size, tp, name, kv, grain) == want, (size, tp, name, kv, grain)
        cases += 1
    assert cases > 1000


FIXTURES = sorted(p.parent.name for p in UNEVEN.glob("*/fixture.json"))


@pytest.mark.skipif(not FIXTURES, reason="no fixtures/data/ds_tp_uneven (python fixtures/generate_ds_tp.py --uneven)")
@pytest.mark.parametrize("fixture", FIXTURES)
def test_layer_names_are_the_ones_autotp_passes(fixture):
    """fixture.json records each shard-size call AutoTP made while it built the model (its layer
    name, size, tp, grain, kv heads and the sizes it got): the rule gives those sizes, and every
    split parameter's name maps to the layer name of a call whose sizes it holds."""
    info = json.loads((UNEVEN / fixture / "fixture.json").read_text())
    calls = info["shard_size_calls"]
    assert calls
    for c in calls:
        got = shard_sizes(c["total_size"], c["mp_size"], c["name"], c["num_kv_heads"], c["tp_grain_size"])
        assert list(got) == c["sizes"], c
    names = {c["name"] for c in calls}
    for param, sizes in info["partition_sizes"].items():
        if sizes is None:
            continue
        assert layer_name(param) in names, (param, names)
        call = next(c for c in calls if c["name"] == layer_name(param))
        assert call["sizes"] == sizes, param


def test_layer_name_is_the_modules_full_name():
    assert layer_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj"
    assert layer_name("model.layers.0.self_attn.q_proj.bias") == "model.layers.0.self_attn.q_proj"
    assert layer_name("lm_head.weight") == "lm_head"


def test_kv_heads_are_probed_as_autotp_does():
    assert kv_heads_of({"num_attention_heads": 6, "num_key_value_heads": 3}) == 3
    assert kv_heads_of({"num_attention_heads": 6}) == 6
    assert kv_heads_of({"text_config": {"num_kv_heads": 2}, "num_attention_heads": 8}) == 2
    assert kv_heads_of({"hidden_size": 8}) is None
