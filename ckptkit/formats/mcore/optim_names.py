"""How Megatron-Core names its optimizer state and groups its parameters, both ways: the reader
maps MCore's keys to per-layer parameter names (convert, consolidate --include-optimizer), a
writer maps them back (the names are one table, here).

MCore's optimizer `sharded_state_dict` keys a parameter's state by the parameter's sharded key:
`optimizer.state.<state>.<param key>` (`exp_avg`, `exp_avg_sq`; `param`, the distributed
optimizer's fp32 main copy), `chained_<N>.` in front when several optimizers are chained (dense
and expert parameters). The parameter key of a decoder layer is the stacked one
(`decoder.layers.X`, [L, ...]); layer i of it is `decoder.layers.<i>.X`, and expert e of a
SequentialMLP's `decoder.layers.mlp.experts.experts.X` ([L, E, ...]) is
`decoder.layers.<i>.mlp.experts.local_experts.<e>.X`, as an MCore model's `state_dict()` names it.

The param groups MCore saves list no parameters: `get_megatron_optimizer` builds them with
`_get_param_groups` (megatron/core/optimizer/__init__.py, 0.16.1) from its standard overrides,
`wd_mult=0.0` for every parameter named `*.bias` or of one dimension (biases and norms), and
`is_expert_parallel` for expert parameters (not all-reduced over data parallel), one group per
distinct pair. `group_of` is that rule; `member_groups` matches it to the groups a checkpoint holds.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

STACKED = "decoder.layers."
EXPERTS = "mlp.experts.experts."
LOCAL_EXPERTS = "mlp.experts.local_experts."
EXPERT_MARK = ".mlp.experts."  # in a per-layer name: an expert parameter (SequentialMLP, grouped GEMM)
STATE_KEY = re.compile(r"(?:chained_([0-9]+)\.)?optimizer\.state\.([A-Za-z_][A-Za-z0-9_]*)\.(.+)")
COMMON_STEP = re.compile(r"(?:chained_([0-9]+)\.)?optimizer\.state\.common_step")
MAIN_PARAM = "param"  # the distributed optimizer's main (fp32) copy of a parameter


class StateKey(NamedTuple):
    """`chained_<chain>.optimizer.state.<state>.<param>` taken apart (chain None: not chained)."""

    chain: int | None
    state: str
    param: str


def split_state_key(key: str) -> StateKey | None:
    """The parts of an MCore optimizer-state key, or None when `key` is none."""
    if COMMON_STEP.fullmatch(key):
        return None
    found = STATE_KEY.fullmatch(key)
    if found is None:
        return None
    chain = found.group(1)
    return StateKey(None if chain is None else int(chain), found.group(2), found.group(3))


def state_key(param: str, state: str, chain: int | None = None) -> str:
    """MCore's key of parameter key `param`'s optimizer state `state` (the inverse of split_state_key)."""
    return (f"chained_{chain}." if chain is not None else "") + f"optimizer.state.{state}.{param}"


def common_step_chain(key: str) -> int | None | bool:
    """The chain of an `optimizer.state.common_step` key (None: not chained), False when it is none."""
    found = COMMON_STEP.fullmatch(key)
    if found is None:
        return False
    return None if found.group(1) is None else int(found.group(1))


def layer_names(key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(per-layer name, leading indices into the stacked tensor) of each layer, and of each expert
    of each layer, of the tensor `key` of `shape`; [(key, ())] for a tensor that is not stacked."""
    rest = key[len(STACKED) :]
    if not key.startswith(STACKED) or not shape or re.match(r"[0-9]+\.", rest):  # (a layer's own name)
        return [(key, ())]
    if rest.startswith(EXPERTS) and len(shape) >= 2:
        tail = rest[len(EXPERTS) :]
        return [(f"{STACKED}{i}.{LOCAL_EXPERTS}{e}.{tail}", (i, e)) for i in range(shape[0]) for e in range(shape[1])]
    return [(f"{STACKED}{i}.{rest}", (i,)) for i in range(shape[0])]


def stacked_name(name: str) -> tuple[str, tuple[int, ...]]:
    """The stacked key and leading indices of a per-layer name (the inverse of layer_names)."""
    found = re.fullmatch(re.escape(STACKED) + r"([0-9]+)\.(.+)", name)
    if found is None:
        return name, ()
    layer, rest = int(found.group(1)), found.group(2)
    expert = re.fullmatch(re.escape(LOCAL_EXPERTS) + r"([0-9]+)\.(.+)", rest)
    if expert is not None:
        return f"{STACKED}{EXPERTS}{expert.group(2)}", (layer, int(expert.group(1)))
    return f"{STACKED}{rest}", (layer,)


class GroupRule(NamedTuple):
    """What MCore's standard grouping decides of one parameter."""

    no_weight_decay: bool  # wd_mult 0.0: a bias or a one-dimensional parameter
    expert: bool  # is_expert_parallel


def group_of(name: str, shape: tuple[int, ...]) -> GroupRule:
    """MCore's standard overrides for the parameter `name` (per-layer) of `shape`."""
    return GroupRule(name.endswith(".bias") or len(shape) == 1, EXPERT_MARK in f".{name}")


def rule_of_group(group: dict[str, Any]) -> GroupRule | None:
    """The rule a saved param group stands for (its wd_mult and is_expert_parallel), or None when
    the group holds anything MCore's standard grouping does not make (another multiplier)."""
    wd_mult, expert = group.get("wd_mult"), group.get("is_expert_parallel")
    if wd_mult not in (0.0, 1.0) or group.get("lr_mult", 1.0) != 1.0 or group.get("is_decoupled_lr"):
        return None
    return GroupRule(wd_mult == 0.0, bool(expert))


def member_groups(
    groups: list[dict[str, Any]], params: list[tuple[str, tuple[int, ...]]]
) -> tuple[list[list[str]], str]:
    """Each saved group's members (names in `params`' order), and '' ; or ([], why) when the saved
    groups are not MCore's standard ones or a parameter fits none of them."""
    rules = [rule_of_group(g) for g in groups]
    if any(r is None for r in rules):
        g = rules.index(None)
        return [], f"param group {g} has multipliers MCore's standard grouping does not make ({_shown(groups[g])})"
    if len(set(rules)) != len(rules):
        return [], "two param groups have the same weight-decay and expert settings"
    members: list[list[str]] = [[] for _ in groups]
    for name, shape in params:
        rule = group_of(name, shape)
        if rule not in rules:
            return [], f"parameter {name} fits none of the saved param groups ({_rule_text(rule)})"
        members[rules.index(rule)].append(name)
    return members, ""


def _rule_text(rule: GroupRule) -> str:
    return f"wd_mult {0.0 if rule.no_weight_decay else 1.0}, is_expert_parallel {rule.expert}"


def _shown(group: dict[str, Any]) -> str:
    keys = ("wd_mult", "lr_mult", "is_decoupled_lr", "is_expert_parallel")
    return ", ".join(f"{k} {group.get(k)!r}" for k in keys if k in group)
