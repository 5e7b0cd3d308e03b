"""Tensor-parallel split rules: which dimension of a parameter its tp ranks split, from its name.

A model-parallel checkpoint stores each tp rank's slice; assembling the full tensor needs the
split, which the files rarely record. A rules file maps name patterns to splits (first match wins):

    {"rules": [
      {"pattern": "*.query_key_value.weight", "fused": 3, "dim": 0},
      {"pattern": "*.dense_4h_to_h.weight", "split": 1},
      {"pattern": "re:.*norm\\.(weight|bias)$", "split": "replicated"}
    ]}

(or the same as TOML, `[[rules]]` tables; `"builtin": false` at the top leaves the built-in rules
out, so a name no rule of the file matches is an error). `pattern` is an fnmatch glob over the parameter name
(`*` also matches dots); a pattern starting with `re:` is a Python regular expression that must
match the whole name. `split` is a dimension or "replicated"; `fused` is the number of equal fused
blocks (Q, K, V: 3) or the list of their sizes along `dim` in the full tensor, each tp rank holding
its share of every block. The built-in rules (builtin_tp_rules/: Megatron and HF names) are used
when no file is given; a file's rules come first and the built-in ones still apply after them.

Lives below the formats layer (tests/test_import_layers.py): the DeepSpeed reader applies it.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from .. import safe_json
from ..errors import FormatError, UnsupportedError, UsageError, quote
from ..regex_guard import MAX_PATTERN as MAX_PATTERN, regex_refusal  # MAX_PATTERN: re-exported

KINDS = ("split", "replicated", "fused")
RECORDED = "recorded-re:"  # a pattern DeepSpeed recorded (matched with re.match)
BUILTIN_FILES = ("megatron.json", "hf.json")
HOW_TO = (
    "write a rule for it in a rules file given with --tp-rules FILE, e.g. "
    '{"rules": [{"pattern": "NAME", "split": 0}]} (or "split": "replicated", or "fused": 3, "dim": 0; '
    "see docs/tp_rules.md)"
)


@dataclass(frozen=True)
class TpSplit:
    """How tp ranks split one tensor: `kind` "split" (along `dim`), "replicated" (every rank holds
    it whole) or "fused" (blocks along `dim`, each rank holding its share of every block: `parts`
    are the blocks' sizes in the full tensor, None for `count` equal blocks). `rule` names what
    decided it (a pattern, or what the checkpoint records)."""

    kind: str
    dim: int | None
    parts: tuple[int, ...] | None = None
    rule: str = ""
    count: int | None = None
    sizes: tuple[int, ...] | None = None  # a rules file's explicit cut: each rank's length along dim

    @property
    def blocks(self) -> int:
        return len(self.parts) if self.parts is not None else (self.count or 1)


@dataclass(frozen=True)
class TpRule:
    pattern: str
    split: TpSplit
    source: str = ""  # the file it came from

    def matches(self, name: str) -> bool:
        return self._compiled(name) is not None

    @cached_property
    def _compiled(self) -> Callable[[str], Any]:
        """The pattern compiled once (re's and fnmatch's caches hold a few hundred: thousands of
        rules would be recompiled for every name)."""
        if self.pattern.startswith("re:"):
            return re.compile(self.pattern[3:]).fullmatch
        if self.pattern.startswith(RECORDED):  # DeepSpeed's own patterns: re.match, as ds_to_universal
            return re.compile(self.pattern[len(RECORDED) :]).match
        return re.compile(fnmatch.translate(self.pattern)).match


@dataclass(frozen=True)
class TpRules:
    rules: tuple[TpRule, ...]
    source: str = "built-in rules"
    refusals: tuple[tuple[str, str], ...] = ()  # (pattern, why): what the checkpoint says cannot be converted

    def find(self, name: str) -> TpSplit | None:
        """The first rule matching `name`, or None; UnsupportedError for a parameter the
        checkpoint itself records as not convertible."""
        if len(name) > MAX_NAME:  # no real parameter name is this long; matching it costs its length cubed
            raise FormatError(
                f"tensor-parallel checkpoint: parameter name {quote(name, 80)} has {len(name)} "
                f"characters, more than the {MAX_NAME} ckptkit matches split rules against"
            )
        for pattern, why in self.refusals:
            if re.match(pattern, name):
                raise UnsupportedError(
                    f"{self.source}: records {quote(name)} as not convertible ({quote(why, 200)}); "
                    f"its tensor-parallel slices cannot be joined"
                )
        for rule in self.rules:
            if rule.matches(name):
                return rule.split
        return None

    def decide(self, name: str, full_shape: tuple[int, ...] | None) -> TpSplit:
        """The split of `name`; UnsupportedError naming the tensor when no rule decides. A rule
        splitting a dimension the tensor lacks is an error too (`full_shape` when known)."""
        split = self.find(name)
        if split is None:
            shape = "" if full_shape is None else f" (shape {list(full_shape)})"
            raise UnsupportedError(
                f"no tensor-parallel split rule matches {quote(name)}{shape} in the {self.source}; {HOW_TO}"
            )
        if full_shape is not None and split.dim is not None and split.dim >= len(full_shape):
            raise UnsupportedError(
                f"tensor-parallel rule {quote(split.rule)} splits dimension {split.dim} of "
                f"{quote(name)}, which has shape {list(full_shape)}; {HOW_TO}"
            )
        if full_shape is not None and split.kind == "fused":
            size = full_shape[split.dim or 0]
            if (sum(split.parts) if split.parts is not None else size) != size or size % split.blocks:
                blocks = list(split.parts) if split.parts is not None else f"{split.blocks} equal blocks"
                raise UnsupportedError(
                    f"tensor-parallel rule {quote(split.rule)} fuses {blocks} along dimension "
                    f"{split.dim or 0} of {quote(name)}, which has {size} there; {HOW_TO}"
                )
        return split

    def then(self, other: "TpRules") -> "TpRules":
        """These rules first, then `other`'s."""
        return TpRules(
            self.rules + other.rules, f"{self.source}, then the {other.source}", self.refusals + other.refusals
        )


def parse_rules(data: Any, where: str) -> TpRules:
    """Rules from a parsed JSON/TOML document ({"rules": [...]} or the list itself)."""
    items = data.get("rules") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise FormatError(f'{where}: expected a list of rules under "rules"')
    if len(items) > MAX_RULES:
        raise FormatError(f"{where}: {len(items)} rules, more than the {MAX_RULES} ckptkit accepts")
    return TpRules(tuple(_rule(item, f"{where}: rule {i}") for i, item in enumerate(items)), where)


def _rule(item: Any, where: str) -> TpRule:
    if not isinstance(item, dict) or not isinstance(item.get("pattern"), str) or not item["pattern"]:
        raise FormatError(f'{where}: expected a table with a "pattern" string')
    pattern = item["pattern"]
    if pattern.startswith("re:"):
        check_regex(pattern[3:], where)
    elif len(pattern) > MAX_PATTERN:
        raise FormatError(f"{where}: pattern of {len(pattern)} characters, more than the {MAX_PATTERN} ckptkit accepts")
    unknown = sorted(set(item) - {"pattern", "split", "fused", "dim", "note", "sizes"})
    if unknown:
        raise FormatError(f"{where}: unknown field(s) {unknown}; a rule has pattern, split or fused (+ dim)")
    if ("split" in item) == ("fused" in item):
        raise FormatError(
            f'{where} ({quote(pattern)}): give exactly one of "split" (a dimension or '
            f'"replicated") and "fused" (a count or a list of block sizes)'
        )
    if "split" in item:
        value = item["split"]
        if value == "replicated":
            return TpRule(pattern, TpSplit("replicated", None, rule=pattern), where)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return TpRule(pattern, TpSplit("split", value, rule=pattern, sizes=_sizes(item, where)), where)
        raise FormatError(
            f'{where} ({quote(pattern)}): split must be a dimension (0, 1, ...) or "replicated", not {value!r:.40}'
        )
    if "sizes" in item:
        raise FormatError(f'{where} ({quote(pattern)}): "sizes" goes with "split" (a dimension), not "fused"')
    fused, dim = item["fused"], item.get("dim", 0)
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise FormatError(f"{where} ({quote(pattern)}): dim must be a dimension (0, 1, ...)")
    if isinstance(fused, int) and not isinstance(fused, bool) and fused >= 1:
        return TpRule(pattern, TpSplit("fused", dim, None, pattern, count=fused), where)
    if (
        isinstance(fused, list)
        and fused
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in fused)
    ):
        return TpRule(pattern, TpSplit("fused", dim, tuple(fused), pattern), where)
    raise FormatError(
        f"{where} ({quote(pattern)}): fused must be a count of equal blocks or a list of positive block sizes"
    )


def _sizes(item: dict, where: str) -> tuple[int, ...] | None:
    """A split rule's "sizes": each tp rank's length along the split dimension, in rank order, for
    writing at tp = their count (a cut the loading job makes unevenly)."""
    if "sizes" not in item:
        return None
    sizes = item["sizes"]
    if not (
        isinstance(sizes, list)
        and 0 < len(sizes) <= MAX_SIZES
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)
    ):
        raise FormatError(
            f"{where} ({quote(item['pattern'])}): sizes must be a list of each tp rank's length along "
            f"the split dimension (at most {MAX_SIZES} of them, none negative)"
        )
    return tuple(sizes)


MAX_SIZES = 65_536  # tp ranks a rule's "sizes" names
MAX_RULES = 100_000  # rules of one file, patterns of one recorded list
MAX_NAME = 1024  # characters of a parameter name matched against the rules (a 3-repeat pattern: ~0.1 s)


def check_regex(pattern: Any, what: str) -> str:
    """`pattern` as a regular expression ckptkit will match names with: a string that compiles
    and that regex_guard finds safe (no nested or alternating repeats, no backreference, few
    unbounded repeats, bounded length), so a failing match cannot backtrack for hours."""
    if not isinstance(pattern, str) or not pattern:
        raise FormatError(f"{what}: expected a non-empty pattern string, not {pattern!r:.60}")
    try:
        why = regex_refusal(pattern)
        if why is None:
            re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise FormatError(f"{what}: {quote(pattern, 80)} is not a regular expression ({exc})") from None
    if why is not None:
        raise FormatError(f"{what}: the pattern {quote(pattern, 80)} {why}")
    return pattern


def _patterns(info: dict, key: str, what: str) -> list[str]:
    """universal_checkpoint_info[key]: a list of regular expressions (absent or None: none)."""
    value = info.get(key)
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise FormatError(f"{what}: {key} is of type {type(value).__name__}, expected a list of pattern strings")
    if len(value) > MAX_RULES:
        raise FormatError(f"{what}: {key} has {len(value)} patterns, more than the {MAX_RULES} ckptkit accepts")
    return [check_regex(p, f"{what}: {key}[{i}]") for i, p in enumerate(value)]


def _parse_text(text: str, where: str, toml: bool) -> Any:
    try:
        return tomllib.loads(text) if toml else safe_json.loads(text, where, "a JSON rules file")
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise FormatError(f"{where}: is not valid {'TOML' if toml else 'JSON'} ({exc})") from None
    except RecursionError:  # tomllib recurses once per nesting level (the JSON reader stops at 64)
        raise FormatError(f"{where}: is nested too deeply for a rules file") from None


def builtin_rules() -> TpRules:
    """The shipped rules: Megatron's names, then HF's."""
    rules: tuple[TpRule, ...] = ()
    for name in BUILTIN_FILES:
        text = resources.files(__package__).joinpath("builtin_tp_rules", name).read_text()
        rules += parse_rules(safe_json.loads(text, f"built-in {name}"), f"built-in {name}").rules
    return TpRules(rules, "built-in rules (Megatron and HF names)")


def load_rules(path: str | None) -> TpRules:
    """The rules of `path` (JSON, or TOML by a .toml suffix) followed by the built-in ones (unless
    the file says "builtin": false); None: the built-in ones alone."""
    if path is None:
        return builtin_rules()
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--tp-rules {quote(path)}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--tp-rules {quote(path)}: cannot be read ({exc})") from None
    data = _parse_text(text, quote(path), file.suffix.lower() == ".toml")
    own = parse_rules(data, f"rules file {quote(path)}")
    builtin = data.get("builtin", True) if isinstance(data, dict) else True
    if not isinstance(builtin, bool):
        raise FormatError(f'rules file {quote(path)}: "builtin" must be true or false')
    return own.then(builtin_rules()) if builtin else own


# The rules file the command line named (--tp-rules), for readers not handed rules explicitly.
_chosen: str | None = None


def use_rules_file(path: str | None) -> None:
    """Make `path` the rules file of this process (the CLI's --tp-rules); it is checked now."""
    global _chosen
    if path is not None:
        load_rules(path)
    _chosen = path


def chosen_rules_file() -> str | None:
    return _chosen


def recorded_rules(info: Any, where: str) -> TpRules | None:
    """Rules from what DeepSpeed recorded (`universal_checkpoint_info`: Megatron-DeepSpeed's or
    AutoTP's pattern lists), or None when it records no tp patterns. ds_to_universal's own order:
    replicated, averaged (read as replicated), 2 sub-params along dim 0, sub-params, row-parallel
    (dim 1), vocabulary (dim 0), else dim 0; patterns match as `re.match`. Its `affine_map` (AutoTP)
    and `sub_param_shard_widths` are not read; `autotp_unsupported_parameter_patterns` refuse."""
    if not isinstance(info, dict):
        return None
    lists = (
        "tp_replicated_parameter_patterns",
        "parameter_with_row_parallelism_patterns",
        "vocabulary_parameter_patterns",
        "parameter_with_sub_params",
        "parameter_with_2_sub_params_cat_dim_0",
        "parameter_to_average_patterns",
    )
    if not any(k in info for k in lists):
        return None
    rules: list[TpRule] = []
    what = f"{where}: universal_checkpoint_info"
    for pat in _patterns(info, "tp_replicated_parameter_patterns", what):
        rules.append(TpRule(RECORDED + pat, TpSplit("replicated", None, rule=f"{what} replicated {pat}"), what))
    for pat in _patterns(info, "parameter_to_average_patterns", what):
        # ds_to_universal averages these over the tp ranks (copies that may drift apart); the
        # index reads rank 0's and verify --deep reports copies that differ
        rules.append(TpRule(RECORDED + pat, TpSplit("replicated", None, rule=f"{what} averaged {pat}"), what))
    for pat in _patterns(info, "parameter_with_2_sub_params_cat_dim_0", what):
        rules.append(TpRule(RECORDED + pat, TpSplit("fused", 0, None, f"{what} 2 sub-params {pat}", count=2), what))
    subs = info.get("parameter_with_sub_params") or []
    if not isinstance(subs, (list, tuple)):
        raise FormatError(f"{what}: parameter_with_sub_params is of type {type(subs).__name__}, expected a list")
    for i, sub in enumerate(subs):
        if not isinstance(sub, dict):
            continue
        dim = sub.get("partition_dim")
        shape = sub.get("shape") or []
        ok_dim = (
            isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim < len(shape)
            if isinstance(shape, (list, tuple))
            else False
        )
        sizes = shape[dim] if ok_dim else None
        parts = tuple(sizes) if isinstance(sizes, (list, tuple)) else None
        if parts is not None and not (
            parts and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in parts)
        ):
            parts, sizes = None, None
        if not ok_dim or (
            parts is None and not (isinstance(sizes, int) and not isinstance(sizes, bool) and sizes >= 1)
        ):
            raise FormatError(
                f"{what}: parameter_with_sub_params entry {sub!r:.120} has no partition_dim "
                f"and sub-param sizes ckptkit can read"
            )
        for pat in _patterns(sub, "patterns", f"{what}: parameter_with_sub_params[{i}]"):
            rules.append(
                TpRule(
                    RECORDED + pat,
                    TpSplit("fused", dim, parts, f"{what} sub-params {pat}", count=None if parts else int(sizes)),
                    what,
                )
            )
    for pat in _patterns(info, "parameter_with_row_parallelism_patterns", what):
        rules.append(TpRule(RECORDED + pat, TpSplit("split", 1, rule=f"{what} row-parallel {pat}"), what))
    for pat in _patterns(info, "vocabulary_parameter_patterns", what):
        rules.append(TpRule(RECORDED + pat, TpSplit("split", 0, rule=f"{what} vocabulary {pat}"), what))
    rules.append(TpRule("*", TpSplit("split", 0, rule=f"{what} (any other parameter: dim 0)"), what))
    unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
    refusals = (
        tuple(
            (check_regex(p, f"{what}: autotp_unsupported_parameter_patterns"), str(why))
            for p, why in unsupported.items()
        )
        if isinstance(unsupported, dict)
        else ()
    )
    return TpRules(tuple(rules), what, refusals)
