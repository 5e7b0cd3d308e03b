"""The one way ckptkit parses JSON it did not write in this process: within limits, one sentence.

Checkpoints carry JSON (safetensors headers, model.safetensors.index.json, safetensors
__metadata__ values, DeepSpeed configs) and users pass some (--ds-config). Python's json module
recurses once per nesting level and raises RecursionError (or worse, with a raised recursion
limit) on input nested 100 000 deep, and every later walk of the value would recurse as deep. So
the nesting depth is measured on the text first (strings removed, brackets counted, all at C
speed) and anything deeper than ckptkit.knobs.MAX_JSON_DEPTH is refused before parsing.

A small text can also parse into far more memory than it takes: `[{},{},...]` costs about 24
bytes in Python per byte of text. Callers reading a file whose size they only cap (a trainer
state, a model config) pass `bounded=True`: the values are counted on the text first (commas and
opening brackets outside strings, a bound from above) and refused when, at VALUE_BYTES each, they
would take more than the memory budget or twice the text, whichever is larger.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from . import knobs
from .errors import CkptkitError, FormatError, quote

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
VALUE_BYTES = 64  # what one parsed value costs at most, about: an empty dict and its slot in a list


def _bare(data: bytes) -> bytearray:
    """`data` (UTF-8) with every string blanked out, in one copy: re.sub would keep a list of every
    piece between two matches, 30 times the text for `{},{},...` (a 15 MB text took 430 MB)."""
    buf = bytearray(data)
    for m in _STRING.finditer(data):
        start, end = m.span()
        buf[start:end] = bytes(end - start)
    return buf


def _depth(bare: bytearray) -> int:
    return max(accumulate(map(_STEP.__getitem__, bare.translate(None, _NOT_BRACKET))), default=0)


def _values(bare: bytearray) -> int:
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{") + 1


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def depth(text: str) -> int:
    """The deepest nesting of arrays and objects in a JSON text (0 for a scalar)."""
    return _depth(_bare(_utf8(text)))


def values(text: str) -> int:
    """At least as many as the values a JSON text holds (scalars, arrays, objects; keys apart)."""
    return _values(_bare(_utf8(text)))


class _DuplicateKey(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    """An object's pairs as a dict, refusing a key given twice (json's own dict keeps the last)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _DuplicateKey(twice)
    return value


def loads(
    raw: bytes | str,
    label: str,
    what: str = "JSON",
    error: type[CkptkitError] = FormatError,
    max_bytes: int | None = None,
    bounded: bool = False,
    unique_keys: bool = False,
) -> Any:
    """Parse `raw` (from `label`); any problem is `error` with one sentence naming `label`.
    `bounded`: refuse a text whose values would take more memory than the budget allows.
    `unique_keys`: refuse an object that gives a key twice (a reader that keeps the first and one
    that keeps the last would read two different files)."""
    if max_bytes is not None and len(raw) > max_bytes:
        raise error(f"{label}: {what} is {len(raw):,} bytes, more than the {max_bytes:,} expected")
    if isinstance(raw, (bytes, bytearray, memoryview)):
        data = bytes(raw)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{label}: {what} is not UTF-8 text (byte {exc.start})") from None
    else:
        text, data = raw, _utf8(raw)
    bare = _bare(data)
    del data
    limit = knobs.MAX_JSON_DEPTH
    if _depth(bare) > limit:
        raise error(f"{label}: {what} is nested more than {limit} levels deep (limit ckptkit.knobs.MAX_JSON_DEPTH)")
    if bounded:
        _check_values(_values(bare), len(text), label, what, error)
    del bare
    try:
        return json.loads(text, object_pairs_hook=_unique) if unique_keys else json.loads(text)
    except _DuplicateKey as exc:
        raise error(f"{label}: {what} gives the key {quote(str(exc), 60)} twice in one object") from None
    except RecursionError:
        raise error(f"{label}: {what} is nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise error(f"{label}: {what} is not valid JSON ({str(exc)[:160]})") from None


def _check_values(found: int, size: int, label: str, what: str, error: type[CkptkitError]) -> None:
    from .runner import limits

    allowed = max(limits.budget(), 2 * size) // VALUE_BYTES
    if found > allowed:
        raise error(
            f"{label}: {what} holds up to {found:,} values, more than the {allowed:,} the memory budget "
            f"allows to parse ({VALUE_BYTES} bytes each; raise --memory-budget or CKPTKIT_MEMORY_BUDGET "
            f"if this is expected)"
        )
