"""Which layers a `PipelineModule` builds on each stage: DeepSpeed's `partition_method`.

The checkpoint does not record the method, so `reshard --partition-method` names it (default
"parameters", PipelineModule's own default). All are ports of deepspeed.runtime.utils and
PipelineModule._partition_layers (no deepspeed import in the library): "uniform" is
partition_uniform over the layer count, "parameters" partition_balanced over each layer's
trainable parameter count (a tied layer counts its module's parameters every time it appears, as
PipelineModule._count_layer_params does), "type:REGEX" partition_balanced over 1 for each layer
whose class (or function) name the regex finds, case-insensitively (_find_layer_type).

No file of a DeepSpeed checkpoint records the layers' class names (layer files hold state dicts,
the mp_rank files module=None, param_shapes and the config; Megatron-DeepSpeed's `args` do not
name them either), so "type:" needs them from the user: `--layer-types`, PipelineModule's layer
list in order as DeepSpeed logs it at start-up (`stage=0 layers=N` then `0: EmbeddingPipe` ...),
`NAME*K` for K in a row. The list also fixes the layer count, which the checkpoint does not show
when state-less layers (functions) end the model. tests/test_ds_pp_reshard.py checks the
functions against DeepSpeed's.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from ...errors import UsageError
from ...regex_guard import regex_refusal

METHODS = ("parameters", "uniform", "type:REGEX")
_chosen: str | None = None
_layer_types: tuple[str, ...] | None = None


def is_type_method(method: str) -> bool:
    return method.lower().startswith("type:")


def use_partition_method(method: str | None) -> None:
    """The command line's --partition-method for this process (None: the default)."""
    global _chosen
    if method is not None and method not in METHODS[:2] and not is_type_method(method):
        raise UsageError(f"--partition-method {method!r}: expected one of {', '.join(METHODS)}")
    if method is not None and is_type_method(method):
        type_regex(method)
    _chosen = method


def chosen_partition_method() -> str:
    return _chosen or "parameters"


def parse_layer_types(text: str) -> tuple[str, ...]:
    """`--layer-types A,B*3,C`: one name per PipelineModule layer, NAME*K for K in a row."""
    out: list[str] = []
    for item in text.split(","):
        name, star, count = item.strip().rpartition("*") if "*" in item else (item.strip(), "", "")
        if not name or (star and not (count.isdigit() and int(count) > 0)):
            raise UsageError(
                f"--layer-types {text!r}: {item.strip()!r} is not a layer's class name or NAME*COUNT "
                f"(expected e.g. EmbeddingPipe,ParallelTransformerLayerPipe*24,LayerNorm)"
            )
        out += [name] * (int(count) if star else 1)
    return tuple(out)


def use_layer_types(text: str | None) -> None:
    """The command line's --layer-types for this process (None: not given)."""
    global _layer_types
    _layer_types = parse_layer_types(text) if text is not None else None


def chosen_layer_types() -> tuple[str, ...] | None:
    return _layer_types


def type_regex(method: str) -> re.Pattern:
    """The regex of "type:REGEX" as _partition_layers takes it: the method lower-cased, the text
    between the first and second colon, matched case-insensitively with search()."""
    pattern = method.lower().split(":")[1]
    try:
        why = regex_refusal(pattern)  # a pattern that could backtrack for hours (ckptkit/regex_guard.py)
        compiled = re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise UsageError(f"--partition-method {method!r}: {pattern!r} is not a regular expression ({exc})") from None
    if why is not None:
        raise UsageError(f"--partition-method {method!r}: the pattern {pattern!r} {why}")
    return compiled


def type_weights(method: str, layer_types: Sequence[str]) -> list[int]:
    """_find_layer_type's binary weights: 1 for each layer whose name the regex finds."""
    regex = type_regex(method)
    weights = [1 if regex.search(name) else 0 for name in layer_types]
    if not any(weights):  # DeepSpeed: "Partitioning '...' found no valid layers to partition."
        raise UsageError(
            f"--partition-method {method}: no name in --layer-types matches {regex.pattern!r}, so "
            f"DeepSpeed would find no layers to partition"
        )
    return weights


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_uniform: stage boundaries, earlier stages take the rest."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_balanced: the linear partition that minimises the spread
    (max - min) of the stages' weights, ties going to the later split point as DeepSpeed's `>=`."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + float(w)  # numpy's float64 cumsum
    dp_max[0][0] = 0
    dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                span = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], span)
                min_sum = min(dp_min[k][j - 1], span)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = k
    parts = [n]
    for i in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][i])
    parts.reverse()
    return parts


def partition(method: str, weights: Sequence[int], num_parts: int) -> list[int]:
    """Stage boundaries (num_parts + 1 of them) of `weights` (one per layer) by `method`."""
    if method == "uniform":
        return partition_uniform(len(weights), num_parts)
    if method == "parameters" or is_type_method(method):  # type: weights are already 0 or 1
        return partition_balanced(weights, num_parts)
    raise UsageError(f"--partition-method {method!r}: expected one of {', '.join(METHODS)}")
