"""The differential oracle's judge: what ckptkit reads from a mutant, what the framework reads from
the same bytes, and whether the two may differ.

A mutant is judged in one process, both sides on the very same file:
- ckptkit accepts when `verify --deep` finds nothing (ckptkit.ops.verify.check); every tensor is
  then fetched as consolidate fetches it. A CkptkitError is a refusal; any other exception escapes
  (the contract is: bad input is a CkptkitError, or it is read right).
- the framework's reader (torch.load(weights_only=True), safetensors.torch.load_file, DCP's
  `_load_state_dict` as dcp_to_torch_save calls it, DeepSpeed's zero_to_fp32) accepts when it
  returns; any exception it raises is its refusal.
Both accept: the same tensor names, and each tensor bit-equal (dtype, shape, bytes: NaN-aware).
ckptkit accepts where the framework refuses: a finding, unless docs/reliability.md lists the
operator under "Differences from the frameworks, on purpose" (the one place such differences live).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
RELIABILITY_DOC = ROOT / "docs" / "reliability.md"
INTENDED_HEADING = "## Differences from the frameworks, on purpose"


@dataclass
class Mutant:
    """One mutated copy of a fixture: `path` is what both readers open."""

    fmt: str
    operator: str
    description: str
    path: Path


@dataclass
class Read:
    """What one side read: flat key -> tensor, or the refusal's text."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> target: ckptkit's own alias records
    refusal: str | None = None


@dataclass(frozen=True)
class Intended:
    """One row of the doc's table: mutants of `operator` that the framework refuses with a message
    matching `refusal` may be read by ckptkit (an id without operator names a comparison rule)."""

    id: str
    operator: str
    refusal: str

    def allows(self, operator: str, message: str) -> bool:
        return self.operator == operator and re.search(self.refusal, message) is not None


def intended_differences(doc: Path = RELIABILITY_DOC) -> dict[str, Intended]:
    """The rows of the table under INTENDED_HEADING: | `id` | `operator` | `refusal regex` | why |."""
    text = doc.read_text()
    start = text.find(INTENDED_HEADING)
    if start < 0:
        return {}
    section = text[start + len(INTENDED_HEADING) :]
    end = section.find("\n## ")
    rows = {}
    for line in (section if end < 0 else section[:end]).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and all(re.fullmatch(r"`[^`]*`|-?", c) for c in cells[:3]) and cells[0].startswith("`"):
            ident, operator, refusal = (c.strip("`") for c in cells[:3])
            rows[ident] = Intended(ident, operator, refusal)
    return rows


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict under the flat keys ckptkit gives them (DCP's rule)."""
    from ckptkit.index.flatten import flatten, key_of

    if isinstance(state, torch.Tensor):
        return {"": state}
    if not isinstance(state, Mapping):
        return {}
    return {
        key_of(p): v for p, v in flatten(state, lambda v: isinstance(v, torch.Tensor)) if isinstance(v, torch.Tensor)
    }


def ckptkit_read(path: Path) -> Read:
    """verify --deep, then every tensor fetched; only a CkptkitError counts as a refusal."""
    from ckptkit.errors import CkptkitError
    from ckptkit.ops.verify import check
    from ckptkit.runner.fetch import Fetcher

    try:
        report = check(str(path), deep=True)
        if not report.ok:
            return Read(refusal=report.problems[0].message)
        index = report.opened.index
        fetcher = Fetcher(report.opened.source, index=index)
        tensors = {k: fetcher.fetch(t) for k, t in index.tensors.items()}
    except CkptkitError as exc:
        return Read(refusal=str(exc))
    aliases = {k: t.attrs["alias_of"] for k, t in index.tensors.items() if t.attrs.get("alias_of")}
    return Read(tensors, aliases)


def ckptkit_consolidated(path: Path, out: Path) -> Read:
    """verify --deep, then consolidate to `out` (a .safetensors file), read back by the safetensors
    library with the aliases consolidate reports (tied parameters) as their targets' tensors."""
    from safetensors.torch import load_file

    from ckptkit.errors import CkptkitError
    from ckptkit.ops.consolidate import consolidate
    from ckptkit.ops.verify import check

    try:
        report = check(str(path), deep=True)
        if not report.ok:
            return Read(refusal=report.problems[0].message)
        result = consolidate(str(path), str(out))
    except CkptkitError as exc:
        return Read(refusal=str(exc))
    tensors = load_file(str(out))
    for alias, target in result.aliases.items():
        tensors[alias] = tensors[target]
    return Read(tensors)


def upcast_to_ours(key: str, ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """consolidate writes floating tensors as float32 where zero_to_fp32 keeps a frozen parameter or
    buffer in its saved half precision (exact: every half value is a float32 value)."""
    if ours.dtype == torch.float32 and theirs.is_floating_point() and theirs.dtype != torch.float32:
        return theirs.float()
    return theirs


def framework_read(load: Callable[[Path], Any], path: Path) -> Read:
    """The framework's own loader; whatever it raises is its refusal."""
    try:
        return Read(flat_tensors(load(path)))
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        failures = getattr(exc, "failures", None)  # DCP's CheckpointException: its ranks' exceptions
        if isinstance(failures, dict) and failures:
            exc = next(iter(failures.values()))
            exc = exc[0] if isinstance(exc, tuple) else exc
        return Read(refusal=f"{type(exc).__name__}: {str(exc)[:200]}")


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when bit-equal, else what differs."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.is_meta or b.is_meta:
        return "a meta tensor (no data) on one side"
    a8 = a.detach().contiguous().reshape(-1).view(torch.uint8)
    b8 = b.detach().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(a8, b8):
        return "bytes differ"
    return None


def compare(
    mutant: Mutant,
    ours: Read,
    theirs: Read,
    intended: Mapping[str, Intended],
    adjust: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> str | None:
    """The finding for one mutant, or None. `adjust(key, ours, theirs)` maps the framework's tensor
    where a listed difference says how (ZeRO's frozen parameters upcast, for one)."""
    if ours.refusal is not None:
        return None
    if theirs.refusal is not None:
        if any(row.allows(mutant.operator, theirs.refusal) for row in intended.values()):
            return None
        return f"ckptkit accepts, the framework refuses ({theirs.refusal})"
    restored = set(ours.aliases) - set(theirs.tensors) if "restored-alias" in intended else set()
    for alias in sorted(restored):  # a tied tensor ckptkit restored: the value of the tensor it names
        target = _resolved(alias, ours.aliases)
        diff = (
            same_tensor(ours.tensors[alias], theirs.tensors[target])
            if target in theirs.tensors
            else f"names {target!r}, which the framework does not read"
        )
        if diff is not None:
            return f"restored alias {alias!r}: {diff}"
    names = set(ours.tensors) - restored
    if names != set(theirs.tensors):
        extra, missing = sorted(names - set(theirs.tensors)), sorted(set(theirs.tensors) - names)
        return f"tensor names differ: only ckptkit {extra[:5]}, only the framework {missing[:5]}"
    for key in sorted(names):
        want = theirs.tensors[key] if adjust is None else adjust(key, ours.tensors[key], theirs.tensors[key])
        diff = same_tensor(ours.tensors[key], want)
        if diff is not None:
            return f"tensor {key!r}: {diff}"
    return None


def _resolved(name: str, aliases: Mapping[str, str]) -> str:
    seen = set()
    while name in aliases and name not in seen:
        seen.add(name)
        name = aliases[name]
    return name
