"""What convert leaves out, only ever on request: `--model-only` and `--drop GLOB`.

Every tensor and object convert reads is carried to the target, rebuilt by it (the state's
`derived`: DeepSpeed's low-precision copies and layout values), or dropped because the user asked
(the state's `dropped`, which the summary lists with why). Anything else (`unmapped`: a value
ckptkit reads but cannot place) stops the command with one sentence saying what would be lost
and how to drop it, before anything is written.

GLOBs match canonical keys (fnmatch, case-sensitive): `model.<name>` (buffers, frozen and tied
tensors: a trainable parameter goes only with the whole optimizer), `optim.state.<name>.<key>`,
`optim.param_groups.<g>.<hyper>` (all of them, with all of the state: the whole optimizer),
an extra's dotted path (`extra.epoch`), DeepSpeed's values (`ds.lr_scheduler`), the source
key of an unmapped value, and the name of a file the reader could not read (`meta.pt`).
"""

from __future__ import annotations

import fnmatch
import os
from typing import Iterable

from ..errors import UnsupportedError, UsageError
from ..index.state_keys import model_key, param_group_key, state_key
from .state import TrainingState, flat_extras

ON_REQUEST = "--drop"
MODEL_ONLY = "--model-only"


def _key(path: Iterable) -> str:
    return ".".join(map(str, path))


def _matcher(globs: tuple[str, ...], used: set[str]):
    def match(key: str) -> str | None:
        for g in globs:
            if fnmatch.fnmatchcase(key, g):
                used.add(g)
                return g
        return None

    return match


def apply_drops(state: TrainingState, model_only: bool = False, drop: tuple[str, ...] = ()) -> None:
    """Remove what the user asked to drop from `state` (recorded in state.dropped, canonical key ->
    why), then refuse, in one sentence, anything still read but not carried (state.unmapped)."""
    request = _Request(model_only, tuple(drop))
    _drop_optimizer(state, request)
    _drop_model_tensors(state, request)
    _drop_values(state, request)
    _drop_unread_files(state, request)
    unused = [g for g in drop if g not in request.used]
    if unused:
        raise UsageError(
            f"--drop {unused[0]} matches nothing convert would write (keys look like {', '.join(_examples(state))})"
        )
    _refuse_unmapped(state)


class _Request:
    """--model-only and the --drop globs, remembering which globs matched something."""

    def __init__(self, model_only: bool, drop: tuple[str, ...]) -> None:
        self.model_only = model_only
        self.used: set[str] = set()
        self.match = _matcher(drop, self.used)

    def why(self, key: str) -> str | None:
        """Why `key` is dropped, None when it is kept."""
        if self.model_only:
            return MODEL_ONLY
        g = self.match(key)
        return f"{ON_REQUEST} {g}" if g is not None else None


def _drop_optimizer(state: TrainingState, request: _Request) -> None:
    """The optimizer: dropped whole (--model-only, or every param-group entry matched) or state by state."""
    model_only, match = request.model_only, request.match
    group_keys = [param_group_key(g, k) for g, h in enumerate(state.groups) for k in list(h) + ["params"]]
    whole_optimizer = model_only or bool(group_keys and all([match(k) is not None for k in group_keys]))
    whole_reason = MODEL_ONLY if model_only else f"{ON_REQUEST} {', '.join(sorted(request.used))} (the whole optimizer)"
    for store in (state.param_states, state.whole_states):
        for name in list(store):
            for k in list(store[name]):
                key = state_key(name, k)
                reason = whole_reason if whole_optimizer else request.why(key)
                if reason is not None:
                    del store[name][k]
                    state.dropped[key] = reason
            if not store[name]:
                del store[name]
    if model_only:
        state.optimizer_dropped = True
    if whole_optimizer and state.has_optimizer:
        for key in group_keys:
            state.dropped[key] = whole_reason
        state.optimizer_dropped = True
    elif not whole_optimizer:
        hit = [k for k in group_keys if match(k) is not None]
        if hit:
            raise UsageError(
                f"--drop matches param-group entries ({', '.join(hit[:3])}) but not all of them: a "
                f"param group goes only with the whole optimizer (drop optim.* or use --model-only)"
            )


def _drop_model_tensors(state: TrainingState, request: _Request) -> None:
    """Model tensors that are not trained: buffers, frozen parameters, tied names."""
    trainable = set(state.trainable)
    for name in list(state.model):
        key = model_key(name)
        if request.model_only or request.match(key) is None:
            continue
        if name in trainable and not state.optimizer_dropped:
            raise UsageError(
                f"--drop {key}: {name} is trained by the optimizer (param group); drop the "
                f"optimizer with it (--drop 'optim.*') or keep it"
            )
        if name in state.ties.values():
            raise UsageError(
                f"--drop {key}: {name} is the weight its tied names "
                f"({', '.join(a for a, o in state.ties.items() if o == name)}) share; drop those, not it"
            )
        del state.model[name]
        for lst in (state.frozen, state.buffers):
            if name in lst:
                lst.remove(name)
        state.ties.pop(name, None)
        state.dropped[key] = f"{ON_REQUEST} {request.match(key)}"


def _drop_values(state: TrainingState, request: _Request) -> None:
    """Extras (as leaves), DeepSpeed's values, and what ckptkit could not place."""
    kept = []
    for path, value in flat_extras(state.extras):
        reason = request.why(_key(path))
        if reason is None:
            kept.append((path, value))
        else:
            state.dropped[_key(path)] = reason
    state.extras = kept
    for k in list(state.ds):
        if k == "ds_config":
            continue  # the config a DeepSpeed target is laid out by; never a value the run needs back
        reason = request.why(f"ds.{k}")
        if reason is not None:
            del state.ds[k]
            state.dropped[f"ds.{k}"] = reason
    for key in list(state.unmapped):
        reason = request.why(key)
        if reason is not None:
            state.dropped[key] = f"{reason} ({state.unmapped.pop(key)})"


def _drop_unread_files(state: TrainingState, request: _Request) -> None:
    """Files the reader could not read (a Lightning meta.pt the restricted unpickler refused): what
    they hold cannot be carried, so leaving them out is only ever the user's explicit choice."""
    for name, unread in (state.source.index.metadata.get("unread") or {}).items():
        reason = request.why(name)
        if reason is None:
            raise UsageError(
                f"{state.source.path}: convert cannot carry {name}, which it could not read "
                f"({unread.rstrip('.')}); to convert without it, drop it explicitly with "
                f"--drop '{name}' or --model-only"
            )
        state.dropped[name] = f"{reason} (a file that could not be read)"


def _refuse_unmapped(state: TrainingState) -> None:
    """Anything still read but not carried stops the command, saying how to drop it."""
    if state.unmapped and state.numbered_why:
        raise UnsupportedError(state.numbered_why)
    if state.unmapped:
        keys = list(state.unmapped)
        by_why: dict[str, list[str]] = {}
        for k in keys:
            by_why.setdefault(state.unmapped[k], []).append(k)
        shown = "; ".join(
            ", ".join(ks[:4]) + (f" and {len(ks) - 4} more" if len(ks) > 4 else "") + f" ({why})"
            for why, ks in by_why.items()
        )
        raise UsageError(
            f"{state.source.path}: convert would lose {len(keys)} value(s) it read and cannot carry "
            f"to any target: {shown}; to go on without them, drop them explicitly with "
            f"--drop '{_glob_for(keys)}' (a glob over these keys, repeatable) or --model-only"
        )


def _glob_for(keys: list[str]) -> str:
    """One glob matching all `keys`: their common dotted prefix and `*` (the key itself if one)."""
    if len(keys) == 1:
        return keys[0]
    prefix = os.path.commonprefix(keys)
    prefix = prefix[: prefix.rfind(".") + 1] if "." in prefix else ""
    return f"{prefix}*"


def _examples(state: TrainingState) -> list[str]:
    keys = [model_key(n) for n in list(state.model)[:1]]
    keys += [state_key(n, k) for n, m in list(state.param_states.items())[:1] for k in list(m)[:1]]
    keys += [_key(p) for p, _ in flat_extras(state.extras)[:1]]
    return keys or ["model.<name>"]


def dropped_summary(state: TrainingState) -> str:
    """`dropped on request: ...` for the summary line, '' when nothing was dropped."""
    if not state.dropped:
        return ""
    by_reason: dict[str, list[str]] = {}
    for key, reason in state.dropped.items():
        by_reason.setdefault(reason.split(" (")[0], []).append(key)
    parts = []
    for reason, keys in by_reason.items():
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        parts.append(f"{len(keys)} by {reason} ({shown})")
    return "dropped on request: " + "; ".join(parts)


__all__ = ["apply_drops", "dropped_summary"]
