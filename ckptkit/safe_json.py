"""The one way ckptkit parses JSON it did not write in this process: within limits, one sentence.

Checkpoints carry JSON (safetensors headers, model.safetensors.index.json, safetensors
__metadata__ values, DeepSpeed configs) and users pass some (--ds-config). Python's json module
recurses once per nesting level and raises RecursionError (or worse, with a raised recursion
limit) on input nested 100 000 deep, and every later walk of the value would recurse as deep. So
the nesting depth is measured on the text first (strings removed, brackets counted, all at C
speed) and anything deeper than ckptkit.knobs.MAX_JSON_DEPTH is refused before parsing.
"""
from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from . import knobs
from .errors import CkptkitError, FormatError

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def depth(text: str) -> int:
    """The deepest nesting of arrays and objects in a JSON text (0 for a scalar)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def loads(raw: bytes | str, label: str, what: str = "JSON", error: type[CkptkitError] = FormatError,
          max_bytes: int | None = None) -> Any:
    """Parse `raw` (from `label`); any problem is `error` with one sentence naming `label`."""
    if max_bytes is not None and len(raw) > max_bytes:
        raise error(f"{label}: {what} is {len(raw):,} bytes, more than the {max_bytes:,} expected")
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{label}: {what} is not UTF-8 text (byte {exc.start})") from None
    else:
        text = raw
    limit = knobs.MAX_JSON_DEPTH
    if depth(text) > limit:
        raise error(f"{label}: {what} is nested more than {limit} levels deep (limit ckptkit.knobs.MAX_JSON_DEPTH)")
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{label}: {what} is nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise error(f"{label}: {what} is not valid JSON ({str(exc)[:160]})") from None
