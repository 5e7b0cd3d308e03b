"""Per-parameter optimizer state, classified by its shape rather than by Adam's names.

Every torch optimizer keeps, per parameter, a dict of values. Whatever their names (`exp_avg`,
`exp_avg_sq`, `momentum_buffer`, `square_avg`, `sum`, `max_exp_avg_sq`, Lion's `exp_avg`...),
a tensor with the parameter's shape (or, inside ZeRO, the flat partition's length) follows the
parameter's partitioning element for element; anything else (torch's 0-d `step`, a per-parameter
scalar) belongs to the parameter as a whole and is kept whole. A few states have a layout of
their own that no repartitioning can follow; those are refused by name, saying what would be needed.
"""

from __future__ import annotations

from typing import Sequence

from .errors import UnsupportedError, quote

PARTITIONED = "partitioned"  # elementwise with the parameter: cut and joined like it
WHOLE = "whole"  # one value per parameter (or per ZeRO group), copied as it is

# names that are per-parameter scalars even when a parameter's shape happens to match (a 0-d param)
WHOLE_NAMES = frozenset({"step"})

_ADAFACTOR = (
    "Adafactor's factored second moment (row and column factors of a 2-D parameter), which is not "
    "elementwise with the parameter: no shard or flat partition of the parameter says which part of "
    "the factors goes with it"
)

# state a repartition cannot follow: key -> why, and what reading it would need
UNMAPPABLE: dict[str, str] = {
    "exp_avg_sq_row": _ADAFACTOR,
    "exp_avg_sq_col": _ADAFACTOR,
    "state1": "bitsandbytes 8-bit optimizer state, quantized in blocks with per-block scales; repartitioning "
    "it would need the blocks dequantized and requantized at the new boundaries",
    "state2": "bitsandbytes 8-bit optimizer state, quantized in blocks with per-block scales; repartitioning "
    "it would need the blocks dequantized and requantized at the new boundaries",
    "absmax1": "bitsandbytes 8-bit optimizer block scales; repartitioning them would need the blocks "
    "dequantized and requantized at the new boundaries",
    "absmax2": "bitsandbytes 8-bit optimizer block scales; repartitioning them would need the blocks "
    "dequantized and requantized at the new boundaries",
    "qmap1": "bitsandbytes 8-bit optimizer quantization map; repartitioning would need the blocks "
    "dequantized and requantized at the new boundaries",
    "qmap2": "bitsandbytes 8-bit optimizer quantization map; repartitioning would need the blocks "
    "dequantized and requantized at the new boundaries",
}


def kind_of(key: str, state_shape: Sequence[int] | None, param_shape: Sequence[int]) -> str:
    """PARTITIONED when a state tensor has the parameter's shape, else WHOLE.

    `state_shape` is None for a value that is not a tensor (an int step, a float). Inside ZeRO
    pass the flat partition's shape, `(partition_length,)`, as `param_shape`."""
    if state_shape is None or str(key) in WHOLE_NAMES:
        return WHOLE
    return PARTITIONED if tuple(state_shape) == tuple(param_shape) else WHOLE


def refuse_unmappable(key: str, where: str) -> None:
    """Raise one sentence naming the state and what mapping it would need, when it is one of those."""
    why = UNMAPPABLE.get(str(key))
    if why is not None:
        raise UnsupportedError(f"{where}: optimizer state {quote(str(key))} cannot be mapped: {why}")


__all__ = ["PARTITIONED", "WHOLE", "UNMAPPABLE", "kind_of", "refuse_unmappable"]
