"""Which layers a `PipelineModule` builds on each stage: DeepSpeed's `partition_method`.

The checkpoint does not record the method, so `reshard --partition-method` names it (default
"parameters", PipelineModule's own default). Both are ports of deepspeed.runtime.utils (no
deepspeed import in the library): "uniform" is partition_uniform over the layer count,
"parameters" partition_balanced over each layer's trainable parameter count (a tied layer counts
its module's parameters every time it appears, as PipelineModule._count_layer_params does).
tests/test_ds_pp_reshard.py checks both against DeepSpeed's functions.
"""
from __future__ import annotations

import math
from typing import Sequence

from ...errors import UsageError

METHODS = ("parameters", "uniform")
_chosen: str | None = None


def use_partition_method(method: str | None) -> None:
    """The command line's --partition-method for this process (None: the default)."""
    global _chosen
    if method is not None and method not in METHODS:
        raise UsageError(f"--partition-method {method!r}: expected one of {', '.join(METHODS)}")
    _chosen = method


def chosen_partition_method() -> str:
    return _chosen or "parameters"


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
    if method == "parameters":
        return partition_balanced(weights, num_parts)
    raise UsageError(f"--partition-method {method!r}: expected one of {', '.join(METHODS)}")
