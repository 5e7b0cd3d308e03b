"""`ckptkit diff`: compare two checkpoints of any formats, tensor by tensor.

Both sides are split into model and optimizer state (ops/keys.py) and model names are
normalised (wrapper prefixes such as `module.`, `_orig_mod.`, `_fsdp_wrapped_module.` dropped),
so an FSDP2 DCP, a ZeRO checkpoint and a safetensors file of the same model line up. Values are
compared slab by slab within the memory budget: equal, or the largest absolute difference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..formats.registry import Opened, open_checkpoint
from ..index import geometry
from ..index.dtypes import itemsize
from ..index.types import Box, TensorEntry
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
    status: str                 # equal | close | different | missing_a | missing_b | dtype | shape
    max_abs_diff: float | None = None
    detail: str = ""


@dataclass
class DiffResult:
    rows: list[Row] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(r.status in ("equal", "close") for r in self.rows)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.status] = out.get(r.status, 0) + 1
        return out


def _named(opened: Opened, model_only: bool) -> dict[str, TensorEntry]:
    split = split_roles(opened.index)
    out: dict[str, TensorEntry] = {}
    for name, key in split.model.items():
        out[normalize(name)] = opened.index.tensors[key]
    if not model_only:
        for name, key in split.optim.items():
            out["optimizer:" + name] = opened.index.tensors[key]
    return out


def diff(a: str, b: str, atol: float = 0.0, model_only: bool = False,
         options: RunOptions | None = None) -> DiffResult:
    options = options or RunOptions()
    oa, ob = open_checkpoint(a), open_checkpoint(b)
    na, nb = _named(oa, model_only), _named(ob, model_only)
    fa, fb = Fetcher(oa.source, index=oa.index), Fetcher(ob.source, index=ob.index)
    result = DiffResult()
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
        result.rows.append(_compare(name, ea, eb, fa, fb, atol, options.slab_bytes))
    return result


def _compare(name: str, ea: TensorEntry, eb: TensorEntry, fa: Fetcher, fb: Fetcher, atol: float,
             slab_bytes: int) -> Row:
    worst = 0.0
    identical = True
    item = max(itemsize(ea.dtype), itemsize(eb.dtype))
    for slab in geometry.split_rowmajor(Box.whole(ea.shape), max(1, slab_bytes // (2 * item))):
        ta, tb = fa.fetch(ea, slab), fb.fetch(eb, slab)
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


def render(result: DiffResult, a: str, b: str, atol: float, show: int = 50) -> str:
    counts = result.counts()
    lines = [f"a: {a}", f"b: {b}",
             "compared " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + (f" (atol {atol:g})" if atol else "")]
    shown = [r for r in result.rows if r.status not in ("equal",)]
    for r in shown[:show]:
        extra = f"max |a-b| {r.max_abs_diff:.6g}" if r.max_abs_diff is not None else r.detail
        lines.append(f"  {r.status:<9} {r.name}  {extra}")
    if len(shown) > show:
        lines.append(f"  ... and {len(shown) - show} more (use --json for all)")
    lines.append("equal" if result.equal else "not equal")
    return "\n".join(lines)
