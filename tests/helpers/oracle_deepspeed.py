"""The oracle's operators on DeepSpeed ZeRO checkpoints: partition fields of the model and optimizer
files (partition_count, param_shapes, the flat fp32 groups' lengths, zero_stage, ds_version,
group_paddings, shared_params, frozen parameters, buffer_names), and rank files swapped.

A file is loaded with torch.load(weights_only=False) - fixtures of this repository only, never a
mutant - changed as an object and written back by torch.save. ckptkit accepts when `verify --deep`
finds nothing and `consolidate` writes; its output is compared with DeepSpeed's zero_to_fp32
(`get_fp32_state_dict_from_zero_checkpoint`), which unpickles with weights_only=False: it reads
only these mutants of our own files, in the test process.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch


def _files(folder: Path, kind: str) -> list[Path]:
    return sorted(p for p in folder.rglob(f"*{kind}_states.pt"))


def _edit(path: Path, change) -> str | None:
    value = torch.load(path, weights_only=False)  # noqa: S614 - a copy of a fixture of this repository
    what = change(value)
    if what is not None:
        path.unlink()  # a hard link to the fixture: replaced, never written through
        torch.save(value, path)
    return what


def partition_count(rng: random.Random, folder: Path):
    def change(o):
        osd = o["optimizer_state_dict"]
        old = osd["partition_count"]
        new = [rng.choice([1, 3, 4, 0]) for _ in old] if isinstance(old, list) else rng.choice([1, 3, 4])
        osd["partition_count"] = new
        return f"partition_count {old} -> {new}"

    return _edit(rng.choice(_files(folder, "optim")), change)


def param_shapes(rng: random.Random, folder: Path):
    files = _files(folder, "model")
    chosen = files if rng.random() < 0.5 else [rng.choice(files)]
    kind = rng.choice(["reverse", "grow", "swap", "rename", "drop"])
    pick = rng.random()

    def change(m):
        groups = m.get("param_shapes")
        if not groups:
            return None
        group = groups[int(pick * len(groups))]
        names = list(group)
        name = names[int(pick * len(names))]
        if kind == "reverse":
            group[name] = torch.Size(list(group[name])[::-1])
        elif kind == "grow":
            group[name] = torch.Size([d + 1 for d in group[name]])
        elif kind == "swap" and len(names) > 1:
            items = list(group.items())
            items[0], items[-1] = items[-1], items[0]
            group.clear()
            group.update(items)
        elif kind == "rename":
            group[name + ".x"] = group.pop(name)
        else:
            del group[name]
        return f"param_shapes {kind} of {name!r}"

    whats = [_edit(f, change) for f in chosen]
    return f"{whats[0]} in {len(chosen)} model file(s)" if whats and whats[0] else None


def flat_group(rng: random.Random, folder: Path):
    delta = rng.choice([-4, -1, 1, 4])

    def change(o):
        osd = o["optimizer_state_dict"]
        key = "single_partition_of_fp32_groups" if "single_partition_of_fp32_groups" in osd else "fp32_flat_groups"
        groups = osd[key]
        i = rng.randrange(len(groups))
        t = groups[i]
        groups[i] = t[:delta].clone() if delta < 0 else torch.cat([t, torch.zeros(delta, dtype=t.dtype)])
        return f"{key}[{i}]: {t.numel()} -> {groups[i].numel()} elements"

    return _edit(rng.choice(_files(folder, "optim")), change)


def zero_stage(rng: random.Random, folder: Path):
    def change(o):
        osd = o["optimizer_state_dict"]
        old = osd["zero_stage"]
        new = type(old)(rng.choice([s for s in (0, 1, 2, 3) if s != int(old)]))
        osd["zero_stage"] = new
        return f"zero_stage {int(old)} -> {int(new)}"

    return _edit(rng.choice(_files(folder, "optim")), change)


def ds_version(rng: random.Random, folder: Path):
    new = rng.choice(["0.3.0", "0.10.0", "1.0.0", "", "x"])
    f = rng.choice(_files(folder, "optim") + _files(folder, "model"))

    def change(o):
        old = o.get("ds_version")
        o["ds_version"] = new
        if "optimizer_state_dict" in o:
            o["optimizer_state_dict"]["ds_version"] = new
        return f"{f.name}: ds_version {old!r} -> {new!r}"

    return _edit(f, change)


def group_paddings(rng: random.Random, folder: Path):
    def change(o):
        osd = o["optimizer_state_dict"]
        if "group_paddings" not in osd:
            return None
        i = rng.randrange(len(osd["group_paddings"]))
        old = osd["group_paddings"][i]
        osd["group_paddings"][i] = max(0, old + rng.choice([-1, 1, 4]))
        return f"group_paddings[{i}] {old} -> {osd['group_paddings'][i]}"

    return _edit(rng.choice(_files(folder, "optim")), change)


def shared_params(rng: random.Random, folder: Path):
    def change(m):
        names = [n for g in m.get("param_shapes") or [] for n in g]
        if len(names) < 2:
            return None
        a, b = rng.sample(names, 2)
        new = rng.choice([{a: b}, {"lm_head.weight": "missing"}, {}, {"new.weight": a}])
        m["shared_params"] = new
        return f"shared_params -> {new}"

    whats = [_edit(f, change) for f in _files(folder, "model")]
    return whats[0]


def frozen(rng: random.Random, folder: Path):
    def change(m):
        shapes, frags = m.get("frozen_param_shapes"), m.get("frozen_param_fragments")
        if not shapes:
            return None
        name = rng.choice(list(shapes))
        if frags and rng.random() < 0.5 and name in frags:
            frags[name] = frags[name].flatten()[:-1].clone()
            return f"frozen_param_fragments[{name!r}] one element short"
        shapes[name] = torch.Size(list(shapes[name])[::-1])
        return f"frozen_param_shapes[{name!r}] reversed"

    whats = [_edit(f, change) for f in _files(folder, "model")]
    return whats[0]


def buffer_names(rng: random.Random, folder: Path):
    def change(m):
        names = m.get("buffer_names") or []
        if not names:
            return None
        kind = rng.choice(["drop", "param"])
        if kind == "drop":
            m["buffer_names"] = names[1:]
            return f"buffer_names without {names[0]!r}"
        m["buffer_names"] = names + [next(iter(m["param_shapes"][0]))]
        return "buffer_names + a parameter's name"

    whats = [_edit(f, change) for f in _files(folder, "model")]
    return whats[0]


def rank_files(rng: random.Random, folder: Path):
    files = _files(folder, "optim")
    a, b = rng.sample(files, 2)
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    return f"optimizer files {a.name} and {b.name} swapped"


OPERATORS = {
    "ds-partition-count": partition_count,
    "ds-param-shapes": param_shapes,
    "ds-flat-group": flat_group,
    "ds-zero-stage": zero_stage,
    "ds-version": ds_version,
    "ds-group-paddings": group_paddings,
    "ds-shared-params": shared_params,
    "ds-frozen": frozen,
    "ds-buffer-names": buffer_names,
    "ds-rank-files": rank_files,
}


def framework_load(path: Path) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(path)))


def mutate(name: str, rng: random.Random, fixture: Path, out: Path):
    from helpers.oracle_verdict import Mutant

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(fixture, out, copy_function=os.link)
    what = OPERATORS[name](rng, out)
    if what is None:
        return None
    return Mutant("deepspeed", name, f"{fixture.name}: {what}", out)
