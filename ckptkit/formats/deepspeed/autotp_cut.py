"""How a tensor-parallel target cuts each split parameter: as DeepSpeed's AutoTP would for a
checkpoint AutoTP wrote (autotp_split.py's rule, uneven where the sizes ask for it), in equal
parts for any other (Megatron-style tp, which needs tp to divide every split dimension).

AutoTP's rule reads two model values a checkpoint may not hold; each is taken from, first to last:

- the key/value head count: `--kv-heads N`; the `config.json` in the checkpoint's folder (probed
  as AutoTP probes the model config: `num_key_value_heads`, ..., `num_attention_heads`);
- the grain: `--tp-grain-size N`; the saved DeepSpeed config's
  `tensor_parallel.tp.tp_grain_size`; DeepSpeed's default, 1.

A rule of `--tp-rules FILE` that gives a parameter "sizes" for the target tp cuts it so, before
either. Without a head count, an attention projection (a layer AutoTP would cut by heads) is cut in
equal parts when tp divides it (what AutoTP gives for any head count tp divides) and refused
when it does not. The cut is checked against the source: at the source's own tp it must give
the slices on disk, else the values are not the model's and the write is refused.
"""

from __future__ import annotations

from typing import Any

from ...convert.tp_rules import chosen_rules_file, load_rules
from ...errors import FormatError, UsageError, quote
from ...index.types import CheckpointIndex, TensorEntry
from ...safe_json import loads
from ...storage.source import Source
from .autotp_split import AutoTpValues, cut_by_heads, is_count, kv_heads_entry, layer_name, shard_sizes
from .layout import DeepSpeedLayout
from .tag_writer import saved_config

CONFIG = "config.json"
CONFIG_MAX_BYTES = 16 << 20
MEGATRON_REASON = (
    " (Megatron-style tensor parallelism, which this checkpoint was written with, cuts every split "
    "dimension in equal parts, so tp must divide it)"
)
RULES_REASON = (
    " (the checkpoint was saved without tp, and --tp-rules FILE cuts a split dimension in equal parts, "
    'as Megatron-style tensor parallelism does, unless a rule gives its "sizes" for this tp)'
)

_chosen: dict[str, int | None] = {"kv_heads": None, "grain": None}


def use_autotp_values(kv_heads: int | None = None, grain: int | None = None) -> None:
    """The values of --kv-heads and --tp-grain-size for this process (None: not given)."""
    _chosen["kv_heads"], _chosen["grain"] = kv_heads, grain


def is_autotp(index: CheckpointIndex) -> bool:
    """Whether DeepSpeed's AutoTP wrote the checkpoint: its `affine_map` in
    universal_checkpoint_info, or `tensor_parallel.autotp_size` in the saved config."""
    uc = index.objects.get("ds.universal_checkpoint_info")
    if uc is not None and isinstance(uc.data, dict) and isinstance(uc.data.get("affine_map"), dict):
        return True
    tp_cfg = saved_config(index).get("tensor_parallel")
    return isinstance(tp_cfg, dict) and bool(tp_cfg.get("autotp_size"))


def autotp_values(index: CheckpointIndex, source: Source) -> AutoTpValues:
    """The head count and grain AutoTP's rule uses for this checkpoint (module docstring)."""
    kv, kv_from = _chosen["kv_heads"], "--kv-heads"
    if kv is None:
        kv, kv_from = _config_kv_heads(source), f"{source.label(CONFIG)}"
    grain, grain_from = _chosen["grain"], "--tp-grain-size"
    if grain is None:
        grain, grain_from = _saved_grain(index), "the saved DeepSpeed config"
    if grain is None:
        grain, grain_from = 1, "DeepSpeed's default"
    return AutoTpValues(kv, kv_from if kv is not None else "nothing", grain, grain_from)


def _config_kv_heads(source: Source) -> int | None:
    if not source.exists(CONFIG):
        return None
    label = source.label(CONFIG)
    size = source.size(CONFIG)
    config = loads(source.read(CONFIG, 0, size), label, "config.json", max_bytes=CONFIG_MAX_BYTES)
    if not isinstance(config, dict):
        raise FormatError(f"{label}: config.json is not a JSON object")
    found = kv_heads_entry(config)
    if found is None:
        return None
    key, kv = found
    if not is_count(kv):
        raise FormatError(f"{label}: {key}, the key/value head count, must be a positive integer, not {kv!r:.40}")
    assert isinstance(kv, int)
    return kv


def _saved_grain(index: CheckpointIndex) -> int | None:
    tp_cfg = saved_config(index).get("tensor_parallel")
    inner: Any = tp_cfg.get("tp", tp_cfg.get("tensor_parallel")) if isinstance(tp_cfg, dict) else None
    grain = inner.get("tp_grain_size") if isinstance(inner, dict) else None
    return grain if isinstance(grain, int) and not isinstance(grain, bool) and grain > 0 else None


class TpCut:
    """Each split parameter's sizes on the new tp ranks (None: equal parts), and the words that end
    a refusal of sizes tp cannot share equally."""

    def __init__(self, index: CheckpointIndex, source: Source, tp: int) -> None:
        self.tp = tp
        self.autotp = is_autotp(index)
        self.values = autotp_values(index, source) if self.autotp else AutoTpValues()
        self.reason = "" if self.autotp else RULES_REASON if DeepSpeedLayout.of(index).grows_tp else MEGATRON_REASON
        chosen = chosen_rules_file()
        self.user_rules = load_rules(chosen) if chosen is not None else None

    def shares(self, entry: TensorEntry, name: str | None, dim: int | None) -> tuple[int, ...] | None:
        """The sizes along `dim` of each new rank's slice of `entry` (parameter `name`): a rules
        file's explicit "sizes" for this tp first, then AutoTP's rule (None: equal parts)."""
        if dim is None or name is None:
            return None
        explicit = self._explicit(entry, name, dim)
        if explicit is not None or not self.autotp:
            return explicit
        size, layer, v = entry.shape[dim], layer_name(name), self.values
        tp_attr = (entry.attrs.get("parallel") or {}).get("tp") or {}
        if "fused" in tp_attr:
            return None  # AutoTP's fused sub-parameters: each block in equal parts, as before
        if v.kv_heads is None and cut_by_heads(layer, size, 1):
            if size % self.tp == 0 and not tp_attr.get("sizes"):
                return None
            raise UsageError(
                f"--to tp={self.tp}: {quote(name)} is a layer AutoTP cuts by key/value heads, and "
                f"neither --kv-heads nor a config.json in the checkpoint's folder gives their count"
            )
        self._check_source(entry, name, tp_attr)
        sizes = shard_sizes(size, self.tp, layer, v.kv_heads, v.grain)
        if 0 in sizes:
            raise UsageError(
                f"--to tp={self.tp}: AutoTP cuts {quote(name)} into {list(sizes)} along dim {dim} "
                f"({v.kv_heads} key/value heads over {self.tp} ranks), and DeepSpeed keeps an empty "
                f"slice as a frozen parameter, a layout ckptkit does not write yet"
            )
        return sizes

    def _explicit(self, entry: TensorEntry, name: str, dim: int) -> tuple[int, ...] | None:
        """The "sizes" a rule of --tp-rules FILE gives `name` for this tp, checked to add up."""
        if self.user_rules is None:
            return None
        split = self.user_rules.find(name)
        if split is None or split.sizes is None or len(split.sizes) != self.tp:
            return None
        if split.kind != "split" or split.dim != dim or sum(split.sizes) != entry.shape[dim]:
            raise UsageError(
                f"--to tp={self.tp}: rule {quote(split.rule)} cuts {quote(name)} into {list(split.sizes)} "
                f"along dim {split.dim}, but it is split along dim {dim}, of {entry.shape[dim]}"
            )
        return split.sizes

    def _check_source(self, entry: TensorEntry, name: str, tp_attr: dict) -> None:
        """The rule, at the source's tp, gives the source's slices: else the values are not the model's."""
        dim, source_tp = tp_attr.get("dim"), tp_attr.get("size")
        if dim is None or not isinstance(source_tp, int) or source_tp < 1:
            return
        size, v = entry.shape[dim], self.values
        on_disk = tuple(tp_attr.get("sizes") or (size // source_tp,) * source_tp)
        ruled = shard_sizes(size, source_tp, layer_name(name), v.kv_heads, v.grain)
        if ruled != on_disk:
            raise UsageError(
                f"--to tp={self.tp}: {quote(name)} has tensor-parallel slices of {list(on_disk)} along "
                f"dim {dim}, where AutoTP, with {v.kv_heads} key/value heads (from {v.kv_heads_from}) "
                f"and grain {v.grain} (from {v.grain_from}), cuts {list(ruled)}; give the model's "
                f"values with --kv-heads and --tp-grain-size"
            )
