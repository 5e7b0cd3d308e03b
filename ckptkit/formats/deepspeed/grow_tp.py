"""Adding tensor parallelism to a DeepSpeed checkpoint saved without it: `reshard --to
tp=T,...,dp=W --tp-rules FILE` of a MoE or pipeline checkpoint saved at tp 1.

A checkpoint saved at tp 1 holds every parameter whole and cannot say how the model, built at a
larger tp, splits it. The rules file says it (convert/tp_rules.py, docs/tp_rules.md): for each
parameter the first matching rule, the file's own then the built-in ones, gives its split (a
dimension, whole on every rank, or fused blocks). Here the source's index is given those splits
as the tp join (join_tp.py) gives them to a checkpoint read at tp > 1: each entry of a parameter
(model.<name>, optim.state.<name>.<key>, ds_module.<name>) carries attrs["parallel"]["tp"], and
`DeepSpeedNative.splits` the rule's split. The layout is marked `grows_tp`, so its family is the
one of the same model saved with tp (moe -> moe_tp, pipeline -> pipeline_tp: the sizes it may
take) and the writer's tp split (split_tp.py) cuts each tensor through tp_geometry.TpSlicer: in
equal parts (Megatron-style: tp must divide the dimension) unless a rule gives "sizes" for the
target tp; whole tensors stay whole on every rank, as DeepSpeed's mp_rank files hold replicated
parameters.

Refused in one sentence before anything is written: a rule of the file naming (no glob, no
regular expression) a parameter the checkpoint does not have, a parameter no rule decides, a rule
splitting a dimension the parameter lacks or fusing blocks that do not fit (TpRules.decide).
"""

from __future__ import annotations

import dataclasses

from ...convert.tp_rules import TpRules, TpSplit, builtin_rules, chosen_rules_file, load_rules
from ...errors import UnsupportedError, UsageError, quote
from ...index.parallel_spec import ParallelSizes
from ...index.types import CheckpointIndex, TensorEntry
from .layout import RESIZE_RULES, DeepSpeedLayout
from .native import native_of
from .tp_geometry import param_name

GLOB = set("*?[")


def grows_tp(index: CheckpointIndex, to: int | ParallelSizes) -> bool:
    """Whether `--to` adds tp to a checkpoint saved without it whose family --tp-rules can grow."""
    layout = DeepSpeedLayout.of(index)
    return (
        isinstance(to, ParallelSizes)
        and to.tp > 1
        and layout.tp == 1
        and not layout.grows_tp
        and RESIZE_RULES[layout.family].grows_tp
    )


def with_tp_rules(index: CheckpointIndex, to: int | ParallelSizes, rules_file: str | None = None) -> CheckpointIndex:
    """The index to write `--to` from: `index` itself, or, when `--to` adds tp and a rules file is
    given (`rules_file`, else the command line's --tp-rules), `index` with every parameter's split
    from the rules (module docstring). Without a rules file the writer refuses adding tp, naming
    the option (layout.TP_RULES_HINT)."""
    path = rules_file if rules_file is not None else chosen_rules_file()
    if path is None or not grows_tp(index, to):
        return index
    rules = load_rules(path)
    names = _parameters(index)
    _check_named(rules, names, path, index.root)
    splits = {name: _split(rules, name, shape, index.root) for name, shape in names.items()}
    tensors = {key: _with_split(entry, splits) for key, entry in index.tensors.items()}
    native = native_of(index)
    layout = dataclasses.replace(native.layout, grows_tp=True)
    return dataclasses.replace(index, tensors=tensors, native=dataclasses.replace(native, layout=layout, splits=splits))


def _parameters(index: CheckpointIndex) -> dict[str, tuple[int, ...]]:
    """parameter name -> its full shape, in the index's order."""
    out: dict[str, tuple[int, ...]] = {}
    for entry in index.tensors.values():
        name = param_name(entry)
        if name is not None:
            out.setdefault(name, tuple(entry.shape))
    return out


def _check_named(rules: TpRules, names: dict[str, tuple[int, ...]], path: str, root: str) -> None:
    """A rule of the file that names one parameter (a pattern with no glob or regular expression)
    the checkpoint lacks: its names are not the model's (a prefix, a typo), refused."""
    builtin = {(r.pattern, r.source) for r in builtin_rules().rules}
    for rule in rules.rules:
        if (rule.pattern, rule.source) in builtin or rule.pattern.startswith("re:") or GLOB & set(rule.pattern):
            continue
        if rule.pattern not in names:
            raise UsageError(
                f"--tp-rules {quote(path)}: rule {quote(rule.pattern)} names a parameter {root} does not "
                f"have (its parameters are named like {quote(next(iter(names), ''))})"
            )


def _split(rules: TpRules, name: str, shape: tuple[int, ...], root: str) -> TpSplit:
    try:
        return rules.decide(name, shape)
    except UnsupportedError as exc:  # the rules' own sentence, said of this checkpoint
        raise UnsupportedError(f"{root}: adding tensor parallelism: {exc}") from None


def _with_split(entry: TensorEntry, splits: dict[str, TpSplit]) -> TensorEntry:
    """`entry` with its parameter's split recorded as the tp join records it (size 1: saved whole)."""
    name = param_name(entry)
    split = splits.get(name) if name is not None else None
    if split is None:
        return entry
    tp_attr: dict = {"dim": None if split.kind == "replicated" else split.dim, "size": 1}
    if split.kind == "fused":
        tp_attr["fused"] = split.blocks
    parallel = {**(entry.attrs.get("parallel") or {}), "tp": tp_attr}
    return dataclasses.replace(entry, attrs={**entry.attrs, "parallel": parallel})
