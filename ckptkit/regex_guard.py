"""Regular expressions from users and checkpoints, refused when matching one could hang.

Python's `re` backtracks: a pattern such as `(a+)+Z`, `(.+){1,100}Z` or twelve `.*` in a row
takes exponential (or high-polynomial) time on a name that almost matches. Split-rule patterns
come from `--tp-rules` files and from what a checkpoint records (DeepSpeed's
`universal_checkpoint_info`), so each is parsed with Python's own regex parser and its tree is
walked before it is used. Refused, each in one sentence:

- a repeat of something that can match different lengths, unless the repeat is small
  (`{0,4}` at most): `(a+)+`, `(.+){1,100}`, `(\\w+\\s?)+`, `(?:x+x+)+`;
- a repeat (other than a fixed count of a fixed-width part) inside an unbounded or large repeat,
  lookarounds included;
- alternation inside a repeat (`(a|aa)+`, `(\\w|\\d)*`: whether Python's parser has folded the
  branches or not), since overlapping branches multiply the ways to match;
- more than MAX_UNBOUNDED unbounded repeats (`*`, `+`, `{n,}`) in all (twelve `.*` in a row): each
  one multiplies the time a failing match can take by the name's length;
- backreferences and conditionals on a group (`\\1`, `(?P=n)`, `(?(1)a|b)`), verbose mode;
- patterns longer than MAX_PATTERN characters.

Possessive repeats and atomic groups (`a*+`, `(?>...)`) do not backtrack and are not counted.
What real names need stays accepted: `.*\\.q_proj\\.weight`, `layers\\.\\d+\\.mlp\\.(gate|up)_proj`,
`^model\\.embed_tokens\\.weight$`, `(.*)\\.weight`, and DeepSpeed's own patterns.
"""

from __future__ import annotations

import re
from typing import Any

try:  # Python 3.11+
    import re._constants as _c
    import re._parser as _parser
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

MAX_PATTERN = 1000  # characters of one pattern
MAX_UNBOUNDED = 3  # unbounded repeats of one pattern (each multiplies a failing match's time by the name's length)
SMALL_REPEAT = 4  # the largest count a repeat of a variable-length part may have
MAX_WAYS = 1024  # ways one pattern may try at a position: optional parts, alternatives, counts multiply
_UNBOUNDED = _c.MAXREPEAT
_REPEATS = (_c.MAX_REPEAT, _c.MIN_REPEAT)
_POSSESSIVE = getattr(_c, "POSSESSIVE_REPEAT", None)  # Python 3.11+, as atomic groups
_ATOMIC = getattr(_c, "ATOMIC_GROUP", None)
_QUANTIFIER = re.compile(r"[*+]|\{(\d*)(?:,(\d*))?\}")


class HostileRegex(ValueError):
    """Why a pattern is refused (the sentence's tail: what in it, and why it matters)."""


def regex_refusal(pattern: str) -> str | None:
    """Why matching `pattern` could hang ckptkit, or None when it is safe to use; a pattern that
    is not a regular expression at all is re.error (from Python's parser)."""
    if len(pattern) > MAX_PATTERN:
        return f"has {len(pattern)} characters, more than the {MAX_PATTERN} ckptkit accepts"
    try:
        tree = _parser.parse(pattern)
        if tree.state.flags & _c.SRE_FLAG_VERBOSE:
            raise HostileRegex("uses verbose mode ((?x)), which ckptkit does not accept in a name pattern")
        _Walk().items(tree, multiplier=1)
        if _ways(tree) > MAX_WAYS:
            raise HostileRegex(
                f"has more than {MAX_WAYS} ways to match at one place (its optional parts, "
                f"alternatives and counted repeats multiply, as in a?a?a?...aaa), which can take "
                f"exponential time to match"
            )
        _check_alternation_text(pattern)
    except HostileRegex as why:
        return str(why)
    except (RecursionError, OverflowError) as exc:
        return f"cannot be analysed ({type(exc).__name__})"
    return None


class _Walk:
    """One pass over a parse tree: `multiplier` is how many times the enclosing repeats may run
    the current part (1: outside any repeat; _UNBOUNDED: inside an unbounded one)."""

    def __init__(self) -> None:
        self.unbounded = 0

    def items(self, items: Any, multiplier: int) -> None:
        for op, av in items:
            self.item(op, av, multiplier)

    def item(self, op: Any, av: Any, multiplier: int) -> None:
        if op in _REPEATS:
            self.repeat(av, multiplier)
        elif op == _POSSESSIVE:  # never gives back what it took: linear on its own
            self.items(av[2], multiplier)
        elif op == _c.SUBPATTERN:
            if av[1] & _c.SRE_FLAG_VERBOSE:
                raise HostileRegex("uses verbose mode ((?x:...)), which ckptkit does not accept in a name pattern")
            self.items(av[3], multiplier)
        elif op == _ATOMIC:
            self.items(av, multiplier)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            self.items(av[1], multiplier)
        elif op == _c.BRANCH:
            if multiplier > 1:
                raise HostileRegex(
                    "repeats an alternation (such as (a|aa)+), whose overlapping branches can take "
                    "exponential time to match; write the repeated part without |"
                )
            for branch in av[1]:
                self.items(branch, multiplier)
        elif op in (_c.GROUPREF, _c.GROUPREF_EXISTS):
            raise HostileRegex(
                "refers back to a group (\\1, (?P=name), (?(1)...)), which can take exponential "
                "time to match; ckptkit accepts no backreference in a name pattern"
            )

    def repeat(self, av: Any, multiplier: int) -> None:
        low, high, body = av
        if high <= 1:  # x? : present or not, no repetition
            self.items(body, multiplier)
            return
        fixed = _is_fixed(body) and low == high
        if multiplier > 1 and not fixed and (multiplier > SMALL_REPEAT or high > SMALL_REPEAT):
            raise HostileRegex(
                "repeats a part that itself repeats (such as (a+)+ or (?:x+x+)+), which can take "
                "exponential time to match; write it without the nested repetition"
            )
        if not _is_fixed(body) and high > SMALL_REPEAT:
            raise HostileRegex(
                f"repeats {'without bound' if high == _UNBOUNDED else f'up to {high} times'} a part "
                f"that can match different lengths (such as (.+){{1,100}} or (\\w+\\s?)+), which "
                f"can take exponential time to match; write it without the nested repetition"
            )
        if high == _UNBOUNDED:
            self.unbounded += 1
            if self.unbounded > MAX_UNBOUNDED:
                raise HostileRegex(
                    f"has more than {MAX_UNBOUNDED} unbounded repeats (*, +, {{n,}}), and each "
                    f"multiplies the time a failing match takes by the name's length"
                )
        self.items(body, min(multiplier * high, _UNBOUNDED))


def _ways(items: Any) -> int:
    """How many ways `items` can try to match at one place, counted generously and capped just
    above MAX_WAYS (an unbounded repeat counts once here: MAX_UNBOUNDED bounds those)."""
    total = 1
    for op, av in items:
        if op in _REPEATS or op == _POSSESSIVE:
            low, high, body = av
            inner = _ways(body)
            total *= inner if high == _UNBOUNDED else (high - low + 1) * min(inner ** min(high, 64), MAX_WAYS + 1)
        elif op == _c.BRANCH:
            total *= sum(_ways(branch) for branch in av[1])
        elif op == _c.SUBPATTERN:
            total *= _ways(av[3])
        elif op == _ATOMIC:
            total *= _ways(av)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            total *= _ways(av[1])
        total = min(total, MAX_WAYS + 1)
    return total


def _is_fixed(items: Any) -> bool:
    """True when `items` always match the same number of characters (a lookaround: none)."""
    low, high = items.getwidth() if hasattr(items, "getwidth") else _parser.SubPattern(None, items).getwidth()
    return low == high


def _check_alternation_text(pattern: str) -> None:
    """Python's parser folds `(\\w|\\d)` into one character class, so the tree alone misses an
    alternation inside a repeat that was written as one; this reads the text: a group holding `|`
    (at any depth) that a quantifier repeats more than once is refused."""
    stack: list[bool] = [False]  # per open group: does it hold a | (itself or a group inside)
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            i = _class_end(pattern, i)
            continue
        if ch == "(":
            if pattern.startswith("(?#", i):
                i = pattern.index(")", i) + 1
                continue
            stack.append(False)
        elif ch == "|":
            stack[-1] = True
        elif ch == ")" and len(stack) > 1:
            holds_bar = stack.pop()
            if holds_bar and _repeats_more_than_once(pattern, i + 1):
                raise HostileRegex(
                    "repeats an alternation (such as (a|aa)+ or (\\w|\\d)*), whose overlapping "
                    "branches can take exponential time to match; write the repeated part "
                    "without | (a character class such as [\\w\\d] instead)"
                )
            stack[-1] = stack[-1] or holds_bar
        i += 1


def _class_end(pattern: str, start: int) -> int:
    """The index just past the character class opening at `start` (`[]a]` and `[^]a]` hold `]`)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _repeats_more_than_once(pattern: str, at: int) -> bool:
    """Does a quantifier at `at` allow more than one repetition (`*`, `+`, `{n,}`, `{n,m}` with m > 1)?"""
    found = _QUANTIFIER.match(pattern, at)
    if found is None:
        return False
    if found.group(0) in ("*", "+"):
        return True
    low, high = found.group(1), found.group(2)
    if high is None:  # {n} or {n,} (the comma decides) or a literal brace
        return "," in found.group(0) or (low.isdigit() and int(low) > 1)
    return high == "" or int(high) > 1
