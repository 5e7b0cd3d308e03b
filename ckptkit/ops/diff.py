"""`ckptkit diff`: compare two checkpoints of any formats, tensor by tensor.

Both sides are split into model and optimizer state (ops/keys.py) and model names are
normalised (wrapper prefixes such as `module.`, `_orig_mod.`, `_fsdp_wrapped_module.` dropped),
so an FSDP2 DCP, a ZeRO checkpoint and a safetensors file of the same model line up. Values are
compared slab by slab within the memory budget: equal, or the largest absolute difference.
Optimizer steps and param-group hyperparameters are compared by value, whatever their backend
form (DeepSpeed's int step vs AdamW's 0-d tensor); a hyperparameter only one backend keeps
(DeepSpeed's bias_correction, torch's foreach) is listed as "one_side" and is not a difference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..formats.registry import Opened, open_checkpoint
from ..index import geometry
from ..index.dtypes import itemsize
from ..index.types import Box, TensorEntry
from ..progress import Progress
from ..runner.fetch import Fetcher
from .keys import split_roles
from .options import RunOptions

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.",
                    "model.")


def normalize(name: str) -> str:
    """Drop wrapper prefixes anywhere in a dotted name (module._orig_mod.layers.0 -> layers.0)."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix) and len(name) > len(prefix):
                name, changed = name[len(prefix):], True
        for infix in ("._fsdp_wrapped_module.", "._checkpoint_wrapped_module.", "._orig_mod."):
            if infix in name:
                name, changed = name.replace(infix, "."), True
    return name


@dataclass
class Row:
    name: str
    status: str                 # equal | close | different | missing_a | missing_b | dtype | shape | one_side
    max_abs_diff: float | None = None
    detail: str = ""


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
        if name.startswith("state.") and name.endswith(".step") and not entry.shape:
            values[f"optimizer:state.{normalize(name[6:-5])}.step"] = fetcher.fetch(entry).item()
        else:
            out["optimizer:" + _norm_optim(name)] = entry
    for name, key in split.optim_objects.items():
        value = opened.index.objects[key].value
        if name.startswith("state.") and name.endswith(".step"):
            values[f"optimizer:state.{normalize(name[6:-5])}.step"] = _plain(value)
        elif name.startswith("param_groups."):
            if name.endswith(".params") and isinstance(value, list):
                value = [normalize(v) if isinstance(v, str) else v for v in value]
            values["optimizer:" + name] = _plain(value)
    return out, values


def _norm_optim(name: str) -> str:
    for what in ("exp_avg_sq", "exp_avg"):
        if name.startswith("state.") and name.endswith("." + what):
            return f"state.{normalize(name[6:-len(what) - 1])}.{what}"
    return name


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def diff(a: str, b: str, atol: float = 0.0, model_only: bool = False,
         options: RunOptions | None = None) -> DiffResult:
    options = options or RunOptions()
    oa = open_checkpoint(a, follow_links=options.follow_links)
    ob = open_checkpoint(b, follow_links=options.follow_links)
    (na, va), (nb, vb) = _named(oa, model_only), _named(ob, model_only)
    fa, fb = Fetcher(oa.source, index=oa.index), Fetcher(ob.source, index=ob.index)
    result = DiffResult()
    both = set(na) & set(nb)
    options.progress.start(sum(na[n].nbytes + nb[n].nbytes for n in both), "diff")
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
        result.rows.append(_compare(name, ea, eb, fa, fb, atol, options.slab_bytes, options.progress))
    options.progress.close()
    for name in sorted(set(va) | set(vb)):
        result.rows.append(_compare_value(name, va, vb, a, b, atol))
    return result


def _compare_value(name: str, va: dict, vb: dict, a: str, b: str, atol: float) -> Row:
    if name not in va or name not in vb:
        if ".step" in name and name.startswith("optimizer:state."):
            return Row(name, "missing_b" if name in va else "missing_a",
                       detail=f"only in {a if name in va else b}")
        return Row(name, "one_side", detail=f"only in {a if name in va else b}: {va.get(name, vb.get(name))!r}")
    x, y = va[name], vb[name]
    if x == y:
        return Row(name, "equal", 0.0)
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
        delta = abs(float(x) - float(y))
        return Row(name, "close" if delta <= atol else "different", delta, f"{x!r} vs {y!r}")
    return Row(name, "different", None, f"{x!r} vs {y!r}")


def _compare(name: str, ea: TensorEntry, eb: TensorEntry, fa: Fetcher, fb: Fetcher, atol: float,
             slab_bytes: int, progress: Progress | None = None) -> Row:
    worst = 0.0
    identical = True
    item = max(itemsize(ea.dtype), itemsize(eb.dtype))
    for slab in geometry.split_rowmajor(Box.whole(ea.shape), max(1, slab_bytes // (2 * item))):
        ta, tb = fa.fetch(ea, slab), fb.fetch(eb, slab)
        if progress is not None:
            progress.advance(slab.numel * (itemsize(ea.dtype) + itemsize(eb.dtype)))
        if ta.dtype == tb.dtype and (ta.numel() == 0 or _bits(ta).equal(_bits(tb))):
            continue  # bit-identical slab (NaNs included)
        identical = False
        if ta.dtype == torch.bool or tb.dtype == torch.bool:
            worst = max(worst, float((ta != tb).any()))
            continue
        da, db = ta.to(torch.float64), tb.to(torch.float64)
        both_nan = torch.isnan(da) & torch.isnan(db)
        delta = (da - db).abs().masked_fill(both_nan, 0.0)
        worst = max(worst, float(torch.nan_to_num(delta, nan=math.inf).max()))
    if identical and ea.dtype == eb.dtype:
        return Row(name, "equal", 0.0)
    if worst <= atol:
        return Row(name, "close", worst)
    return Row(name, "different", worst, f"max |a-b| = {worst:.6g}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def render(result: DiffResult, a: str, b: str, atol: float, show: int = 50) -> list[str]:
    """The differences, one string per line (the printer escapes each line: ckptkit.text)."""
    counts = result.counts()
    lines = [f"a: {a}", f"b: {b}",
             "compared " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + (f" (atol {atol:g})" if atol else "")]
    shown = [r for r in result.rows if r.status not in ("equal", "one_side")]
    for r in shown[:show]:
        extra = f"max |a-b| {r.max_abs_diff:.6g}" if r.max_abs_diff is not None else r.detail
        lines.append(f"  {r.status:<9} {r.name}  {extra}")
    if len(shown) > show:
        lines.append(f"  ... and {len(shown) - show} more (use --json for all)")
    lines.append("equal" if result.equal else "not equal")
    return lines
