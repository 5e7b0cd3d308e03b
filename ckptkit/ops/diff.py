"""`ckptkit diff`: compare two checkpoints of any formats, tensor by tensor.

Both sides are split into model and optimizer state (convert/keys.py) and model names are
normalised (wrapper prefixes such as `module.`, `_orig_mod.`, `_fsdp_wrapped_module.` dropped),
so an FSDP2 DCP, a ZeRO checkpoint and a safetensors file of the same model line up. Values are
compared slab by slab within the memory budget: equal (bit for bit, NaNs included), or the largest
absolute difference and the relative L2 change ||a-b|| / ||a||, both summed in float64 as the slabs
stream by over the positions where neither side is NaN; positions where exactly one side is NaN are
counted (`nan_mismatches`) and make the tensor different whatever the tolerance.
Optimizer steps and param-group hyperparameters are compared by value, whatever their backend
form (DeepSpeed's int step vs AdamW's 0-d tensor); a hyperparameter only one backend keeps
(DeepSpeed's bias_correction, torch's foreach) is listed as "one_side" and is not a difference.
Everything else the checkpoint holds (extras: `extra.*`, a scheduler's state, client values, and
their tensors) is compared under `extra:<key>`, and the training step as `step`; an extra only one
side has is "one_side" (formats keep different ones), and values that only describe the layout
(DeepSpeed's dp_world_size, zero_stage, ds_config, ...) are not compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from ..formats.registry import Opened, open_checkpoint
from ..index import geometry
from ..index.dtypes import itemsize
from ..index.types import Box, TensorEntry
from ..progress import Progress
from ..runner.fetch import Fetcher
from ..convert.keys import STEP_NAMES, OPTIM_CONTAINERS, guess_step, split_roles
from ..context import RunContext, context_of

LAYOUT_KEYS = frozenset(
    {
        "ds.dp_world_size",
        "ds.mp_world_size",
        "ds.zero_stage",
        "ds.ds_config",
        "ds.ds_version",
        "ds.checkpoint_parallel_dimensions",
    }
)
EXTRA = "extra:"
STAT_TOP = 10  # rows `--stat` shows, largest relative change first

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "model.")


def normalize(name: str) -> str:
    """Drop wrapper prefixes anywhere in a dotted name (module._orig_mod.layers.0 -> layers.0)."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix) and len(name) > len(prefix):
                name, changed = name[len(prefix) :], True
        for infix in ("._fsdp_wrapped_module.", "._checkpoint_wrapped_module.", "._orig_mod."):
            if infix in name:
                name, changed = name.replace(infix, "."), True
    return name


@dataclass
class Row:
    name: str
    status: str  # equal | close | different | missing_a | missing_b | dtype | shape | one_side | unread
    max_abs_diff: float | None = None
    detail: str = ""
    rel_l2: float | None = None  # ||a-b|| / ||a|| (|a-b| / |a| for a number); inf when a is 0 and b is not
    nan_mismatches: int = 0  # positions where exactly one side is NaN (left out of the two above)

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "status": self.status,
            "max_abs_diff": self.max_abs_diff,
            "rel_l2": self.rel_l2,
            "nan_mismatches": self.nan_mismatches,
            "detail": self.detail,
        }


@dataclass
class DiffResult:
    rows: list[Row] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(r.status in ("equal", "close", "one_side") for r in self.rows)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def largest(self, n: int = STAT_TOP) -> list[Row]:
        """The `n` rows that changed most: those with NaN mismatches first (their relative change
        leaves those positions out), then by relative change, then those without one (a string
        value, a shape), in name order."""
        changed = [r for r in self.rows if r.status not in ("equal", "one_side")]
        measured = sorted(
            (r for r in changed if r.rel_l2 is not None), key=lambda r: (-r.nan_mismatches, -r.rel_l2, r.name)
        )
        return (measured + [r for r in changed if r.rel_l2 is None])[:n]


def _named(opened: Opened, model_only: bool) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """(tensors by normalised name, optimizer values by name: steps and hyperparameters)."""
    split = split_roles(opened.index)
    out: dict[str, TensorEntry] = {}
    values: dict[str, Any] = {}
    for name, key in split.model.items():
        out[normalize(name)] = opened.index.tensors[key]
    if model_only:
        return out, values
    fetcher = Fetcher(opened.source, index=opened.index)
    for name, key in split.optim.items():
        entry = opened.index.tensors[key]
        if _is_state(name) and not entry.shape:  # a 0-d state (torch's step): by value, as an int step is
            values["optimizer:" + _norm_optim(name)] = fetcher.fetch(entry).item()
        else:
            out["optimizer:" + _norm_optim(name)] = entry
    for name, key in split.optim_objects.items():
        value = opened.index.objects[key].value
        if _is_state(name):  # any per-parameter state kept whole (a step, a scalar), whatever its key
            values["optimizer:" + _norm_optim(name)] = _plain(value)
        elif name.startswith("param_groups."):
            if name.endswith(".params") and isinstance(value, list):
                value = [normalize(v) if isinstance(v, str) else v for v in value]
            values["optimizer:" + name] = _plain(value)
    return out, values


def _extras(opened: Opened) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """(tensors, values) outside the model and the optimizer, by "extra:<key>", plus "step"."""
    split = split_roles(opened.index)
    index = opened.index
    tensors = {EXTRA + key: index.tensors[key] for key in split.other}
    optim = set(split.optim_objects.values())
    values: dict[str, Any] = {}
    for key, o in index.objects.items():
        path = o.path or (key,)
        if key in optim or _is_layout(key) or (path[0] in OPTIM_CONTAINERS and len(path) > 1):
            continue
        if path[-1] in STEP_NAMES:  # compared as "step" below
            continue
        values[EXTRA + key] = _plain(o.value)
    step = index.step if index.step is not None else guess_step(index)
    if step is not None:
        values["step"] = step
    return tensors, values


def _is_layout(key: str) -> bool:
    """A value that describes the layout, not the training state (also when a DCP flattened it)."""
    return any(key == k or key.startswith(k + ".") for k in LAYOUT_KEYS)


def _is_state(name: str) -> bool:
    """`state.<param>.<key>`: per-parameter optimizer state, whatever the optimizer calls it."""
    return name.startswith("state.") and "." in name[len("state.") :]


def _norm_optim(name: str) -> str:
    """`state.<param>.<key>` with the parameter's name normalised (any state key: the last part)."""
    if _is_state(name):
        param, _, what = name[len("state.") :].rpartition(".")
        return f"state.{normalize(param)}.{what}"
    return name


class ArrayValue:
    """A numpy array inside a value (an RNG state, client state), compared as data: the same dtype,
    shape and bits (NaNs included), as tensors are; numpy's own `==` is elementwise and has no
    single truth value. Shown as numpy shows it."""

    __slots__ = ("array",)

    def __init__(self, array: numpy.ndarray) -> None:
        self.array = array

    def identity(self) -> tuple:
        return (self.array.dtype.str, self.array.shape, numpy.ascontiguousarray(self.array).tobytes())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArrayValue) and self.identity() == other.identity()

    def __hash__(self) -> int:
        return hash(self.identity())

    def __repr__(self) -> str:
        return repr(self.array)


def _plain(value: Any) -> Any:
    """A value as plain data, so two backends' forms of it compare equal (tensors as numbers or
    lists, tuples as lists, numpy arrays by dtype, shape and bits, stand-in objects as their type
    and fields)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, numpy.ndarray):
        return ArrayValue(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {
            "__type__": type(value).__name__,
            **{k: _plain(v) for k, v in vars(value).items() if not k.startswith("_")},
        }
    return value


def diff(
    a: str,
    b: str,
    atol: float = 0.0,
    model_only: bool = False,
    options: RunContext | None = None,
    *,
    ctx: RunContext | None = None,
) -> DiffResult:
    ctx = context_of(ctx, options)
    oa = open_checkpoint(a, follow_links=ctx.follow_links)
    try:
        ob = open_checkpoint(b, follow_links=ctx.follow_links)
        try:
            return _diff_opened(oa, ob, a, b, atol, model_only, ctx)
        finally:
            _close(ob)
    finally:
        _close(oa)


def _close(opened: Opened) -> None:
    """Close the files a checkpoint's source keeps open (a caller may unmount or delete them next)."""
    close = getattr(opened.source, "close", None)
    if close is not None:
        close()


def _diff_opened(oa: Opened, ob: Opened, a: str, b: str, atol: float, model_only: bool, ctx: RunContext) -> DiffResult:
    (na, va), (nb, vb) = _named(oa, model_only), _named(ob, model_only)
    if not model_only:  # extras and the step: what a training run restores besides model and optimizer
        (ta, xa), (tb, xb) = _extras(oa), _extras(ob)
        one_side = set(ta) ^ set(tb)
        na.update({k: v for k, v in ta.items() if k not in one_side})
        nb.update({k: v for k, v in tb.items() if k not in one_side})
        va.update(xa)
        vb.update(xb)
    fa, fb = Fetcher(oa.source, index=oa.index), Fetcher(ob.source, index=ob.index)
    result = DiffResult()
    both = set(na) & set(nb)
    ctx.progress.start(sum(na[n].nbytes + nb[n].nbytes for n in both), "diff")
    for name in sorted(set(na) | set(nb)):
        if name not in nb:
            result.rows.append(Row(name, "missing_b", detail=f"only in {a}"))
            continue
        if name not in na:
            result.rows.append(Row(name, "missing_a", detail=f"only in {b}"))
            continue
        ea, eb = na[name], nb[name]
        if ea.shape != eb.shape:
            result.rows.append(Row(name, "shape", detail=f"{list(ea.shape)} vs {list(eb.shape)}"))
            continue
        if ea.dtype != eb.dtype and atol == 0:
            result.rows.append(Row(name, "dtype", detail=f"{ea.dtype} vs {eb.dtype}"))
            continue
        result.rows.append(_compare(name, ea, eb, fa, fb, atol, ctx.slab_bytes, ctx.progress))
    ctx.progress.close()
    if not model_only:
        for name in sorted(one_side):
            where = a if name in ta else b
            result.rows.append(Row(name, "one_side", detail=f"tensor only in {where}"))
    for name in sorted(set(va) | set(vb)):
        result.rows.append(_compare_value(name, va, vb, a, b, atol))
    result.rows += _unread(oa, a) + _unread(ob, b)
    return result


def _unread(opened: Opened, label: str) -> list[Row]:
    """Files a reader could not read (e.g. a Lightning meta.pt the restricted unpickler refused):
    what they hold was not compared, so the two checkpoints cannot be called equal."""
    unread = opened.index.metadata.get("unread") or {}
    return [Row(f"unread:{name}", "unread", detail=f"not read in {label}: {why}") for name, why in unread.items()]


def _compare_value(name: str, va: dict, vb: dict, a: str, b: str, atol: float) -> Row:
    if name not in va or name not in vb:
        if ".step" in name and name.startswith("optimizer:state."):
            return Row(name, "missing_b" if name in va else "missing_a", detail=f"only in {a if name in va else b}")
        return Row(name, "one_side", detail=f"only in {a if name in va else b}: {va.get(name, vb.get(name))!r}")
    x, y = va[name], vb[name]
    if x == y:
        return Row(name, "equal", 0.0, rel_l2=0.0)
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
        delta = abs(float(x) - float(y))
        return Row(
            name,
            "close" if delta <= atol else "different",
            delta,
            f"{x!r} vs {y!r}",
            rel_l2=_relative(delta * delta, float(x) * float(x)),
        )
    return Row(name, "different", None, f"{_short(x)} vs {_short(y)}")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _relative(diff_sq: float, base_sq: float) -> float:
    """sqrt(diff_sq / base_sq): 0 when nothing changed, inf when a change starts from zero."""
    if diff_sq == 0:
        return 0.0
    if base_sq == 0 or not math.isfinite(base_sq):
        return math.inf
    return math.sqrt(diff_sq / base_sq)


def _compare(
    name: str,
    ea: TensorEntry,
    eb: TensorEntry,
    fa: Fetcher,
    fb: Fetcher,
    atol: float,
    slab_bytes: int,
    progress: Progress | None = None,
) -> Row:
    """Bit for bit first; where the bits differ, the largest |a-b| and the squared sums over the
    positions neither side holds NaN at, and the NaN positions counted apart: a NaN against a
    number is no amount of difference (it was shown as `inf`), and two NaNs of other bits are not
    the same bits."""
    tally = _Tally()
    item = max(itemsize(ea.dtype), itemsize(eb.dtype))
    for slab in geometry.split_rowmajor(Box.whole(ea.shape), max(1, slab_bytes // (2 * item))):
        ta, tb = fa.fetch(ea, slab), fb.fetch(eb, slab)
        if progress is not None:
            progress.advance(slab.numel * (itemsize(ea.dtype) + itemsize(eb.dtype)))
        da = ta.to(torch.float64)
        tally.base_sq += float(torch.nansum(da * da))
        if ta.dtype == tb.dtype and (ta.numel() == 0 or _bits(ta).equal(_bits(tb))):
            continue  # bit-identical slab (NaNs included)
        tally.add(ta, tb, da, tb.to(torch.float64))
    if tally.identical and ea.dtype == eb.dtype:
        return Row(name, "equal", 0.0, rel_l2=0.0)
    rel = _relative(tally.diff_sq, tally.base_sq)
    if tally.nan_mismatches:
        many = "s" if tally.nan_mismatches > 1 else ""
        return Row(
            name,
            "different",
            tally.worst,
            f"{tally.nan_mismatches} position{many} NaN on one side only (max |a-b| and rel L2 over the others)",
            rel_l2=rel,
            nan_mismatches=tally.nan_mismatches,
        )
    if tally.worst <= atol:
        detail = f"{tally.nan_bits} NaN positions with other bits" if tally.nan_bits else ""
        return Row(name, "close", tally.worst, detail, rel_l2=rel)
    return Row(name, "different", tally.worst, f"max |a-b| = {tally.worst:.6g}", rel_l2=rel)


@dataclass
class _Tally:
    """What the slabs whose bits differ add up to (one tensor)."""

    identical: bool = True
    worst: float = 0.0
    base_sq: float = 0.0  # sum a^2 and sum (a-b)^2 in float64, for ||a-b|| / ||a||
    diff_sq: float = 0.0
    nan_mismatches: int = 0
    nan_bits: int = 0  # both NaN, other bits (same dtype only)

    def add(self, ta: torch.Tensor, tb: torch.Tensor, da: torch.Tensor, db: torch.Tensor) -> None:
        self.identical = False
        nan_a, nan_b = torch.isnan(da), torch.isnan(db)
        self.nan_mismatches += int((nan_a ^ nan_b).sum())
        if ta.dtype == tb.dtype:
            self.nan_bits += int((nan_a & nan_b & (_elements(ta) != _elements(tb))).sum())
        # the same value (an infinity too) is no difference; NaN positions are counted above
        delta = torch.where((da == db) | nan_a | nan_b, 0.0, (da - db).abs())
        self.worst = max(self.worst, float(delta.max()) if delta.numel() else 0.0)
        self.diff_sq += float((delta * delta).sum())


def _elements(t: torch.Tensor) -> torch.Tensor:
    """Each element's bits as one integer, for comparing NaN payloads position by position."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.reshape(-1).view(ints[t.element_size()]).reshape(t.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def render(result: DiffResult, a: str, b: str, atol: float, show: int = 50, stat: bool = False) -> list[str]:
    """The differences, one string per line (the printer escapes each line: ckptkit.text).
    `stat`: the counts and the STAT_TOP largest changes only, largest relative change first."""
    counts = result.counts()
    lines = [
        f"a: {a}",
        f"b: {b}",
        "compared " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + (f" (atol {atol:g})" if atol else ""),
    ]
    if stat:
        top = result.largest(STAT_TOP)
        if top:
            lines.append(f"largest changes, top {STAT_TOP} by relative L2 change ||a-b||/||a||:")
            lines.append(f"  {'rel L2':<12} {'max |a-b|':<12} {'status':<9} name")
            lines += [
                f"  {_num(r.rel_l2):<12} {_num(r.max_abs_diff):<12} {r.status:<9} {r.name}"
                + (f"  ({r.detail})" if r.detail and not r.detail.startswith("max |a-b|") else "")
                for r in top
            ]
    else:
        shown = [r for r in result.rows if r.status not in ("equal", "one_side")]
        for r in shown[:show]:
            lines.append(f"  {r.status:<9} {r.name}  {_measure(r) if r.max_abs_diff is not None else r.detail}")
        if len(shown) > show:
            lines.append(f"  ... and {len(shown) - show} more (use --json for all)")
    lines.append("equal" if result.equal else "not equal")
    return lines


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _measure(r: Row) -> str:
    if r.max_abs_diff is None:
        return r.detail
    rel = f"  rel L2 {r.rel_l2:.6g}" if r.rel_l2 is not None else ""
    value = f"  ({r.detail})" if r.detail and not r.detail.startswith("max |a-b|") else ""
    return f"max |a-b| {r.max_abs_diff:.6g}{rel}{value}"
