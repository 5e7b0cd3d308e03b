"""In-job save and load for training code: `ckptkit.save(state_dict, path)`, `ckptkit.load(state_dict, path)`.

Both are collectives when torch.distributed is initialised (every rank calls them) and plain
calls otherwise. The state dict is what `get_state_dict(model, optim)` returns: DTensors
(FSDP2), plain tensors (DDP, one process) and plain values, nested.

save: every rank writes its own shards in parallel with torch.distributed.checkpoint, into a
temporary folder that rank 0 renames into place once every rank succeeded, so `path` is a DCP
checkpoint (torch's `dcp.load` reads it) that exists complete or not at all.

load: fills the state dict in place from a checkpoint of any format ckptkit reads (DCP, DeepSpeed
ZeRO, torch.save, safetensors), whatever world size it was saved at: each rank reads exactly the
byte ranges of its own shards (a DTensor's local box) with ckptkit's reader, so nothing is
unpickled outside the restricted loader and no rank holds more than its share.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from .errors import CkptkitError, FormatError, UnsupportedError, UsageError
from .index.dtypes import torch_dtype
from .index.flatten import Path, flatten, key_of
from .index.types import Box, CheckpointIndex, TensorEntry
from .runner.distributed import group_of
from .framework_errors import framework_cause
from .storage.output import open_output
from .storage.source import is_url, path_text


def save(state_dict: Mapping[str, Any], path: str | os.PathLike, *, pg: Any = None, overwrite: bool = False) -> None:
    """Write `state_dict` as a DCP checkpoint at `path` (a local or mounted path), atomically. Collective."""
    path = path_text(path, "ckptkit.save")
    if is_url(path):  # torch's writer fills a local folder: a URL would send the shards elsewhere
        raise UnsupportedError(
            f"{path}: ckptkit.save writes to a local or mounted path, not a URL; save "
            f"locally, then copy the folder to the store"
        )
    group = group_of(pg)
    refusal = None
    try:
        flat_leaves(state_dict)
    except UsageError as exc:
        refusal = exc
    agree(group, refusal)  # before anything is written: refused on every rank, or written by all
    with open_output(path, overwrite=overwrite, group=group) as out:
        write_dcp(state_dict, out.tmp, pg)


def flat_leaves(state_dict: Mapping[str, Any]) -> list[tuple[Path, Any]]:
    """The leaves of `state_dict` as DCP flattens them (keys joined with dots). Two entries that
    flatten to one name (`{"a.b": x, "a": {"b": y}}`) are a UsageError naming both: DCP would
    fail on them with its own exception, a traceback in its message."""
    if not isinstance(state_dict, Mapping):
        raise UsageError(f"the state dict must be a dict of name -> value (got {type(state_dict).__name__})")
    leaves = flatten(state_dict, lambda v: isinstance(v, torch.Tensor))
    seen: dict[str, Path] = {}
    for path, _ in leaves:
        key = key_of(path)
        if key in seen:
            raise UsageError(
                f"the state dict entries {spell(seen[key])} and {spell(path)} both flatten to the "
                f"name {key!r} (DCP joins nested keys with dots): rename one of them"
            )
        seen[key] = path
    return leaves


def spell(path: Path) -> str:
    """A leaf's path as the subscripts that reach it: `['a']['b']`, `['pair'][0]`."""
    return "".join(f"[{p!r}]" for p in path)


def agree(group: Any, refusal: CkptkitError | None) -> None:
    """Collective: a rank that refused raises its refusal, every other rank the first one's, so no
    rank goes on into a write the others refused (and the group stays usable: it is a refusal)."""
    reports = group.gather_all(None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    first = next((r for r in reports if r is not None), None)
    if first is not None:
        raise UsageError(first)


def write_dcp(state_dict: Mapping[str, Any], folder: str, pg: Any = None) -> None:
    """Every rank of `pg` writes its shards into `folder` (a RenameOutput's temporary; the
    Checkpointer adds its completion marker before the commit), each file fsynced. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    group = group_of(pg)
    writer = FileSystemWriter(folder, sync_files=True)
    try:
        _save_dcp(dcp, state_dict, writer, pg, group.distributed)
    except BaseException as exc:  # torch's CheckpointException is no Exception
        cause = framework_cause(exc)
        if cause is exc:
            raise
        raise cause from None


def _save_dcp(dcp: Any, state_dict: Mapping[str, Any], writer: Any, pg: Any, distributed: bool) -> None:
    """dcp.save of the state dict with `writer`, in a job or in this process alone."""
    if distributed:
        dcp.save(dict(state_dict), storage_writer=writer, process_group=pg)
        return
    # dcp.save warns "torch.distributed is disabled ..." on every one-process save, even when told
    # no_dist=True; the function it hands over to (same arguments, torch >= 2.4) does not
    from torch.distributed.checkpoint import state_dict_saver

    inner = getattr(state_dict_saver, "_save_state_dict", None)
    if inner is None:  # pragma: no cover - a torch that renamed it: its warning is shown
        dcp.save(dict(state_dict), storage_writer=writer, no_dist=True)
    else:
        inner(state_dict=dict(state_dict), storage_writer=writer, no_dist=True)


def load(
    state_dict: dict[str, Any], path: str | os.PathLike, *, tag: str | None = None, follow_links: bool | None = None
) -> dict[str, Any]:
    """Fill `state_dict` in place from the checkpoint at `path` (any format, any world size).

    Tensors are copied into (DTensors: into their local shards); other values are replaced by the
    checkpoint's. Keys follow DCP's flattening (`model.<fqn>`, `optim.state.<fqn>.exp_avg`, ...);
    a DeepSpeed checkpoint is seen through convert's canonical state, so FSDP2 loads ZeRO
    directly. A key the state dict has and the checkpoint lacks, a shape that differs, a tensor
    where the state dict holds a value, or a meta tensor is an error naming it, raised before
    anything is filled. Files are read only inside `path` (links out refused unless
    `follow_links` or CKPTKIT_FOLLOW_LINKS=1)."""
    from .formats.registry import open_checkpoint

    path = path_text(path, "ckptkit.load")
    return load_opened(state_dict, open_checkpoint(path, tag=tag, follow_links=follow_links), path)


def load_opened(state_dict: dict[str, Any], opened: Any, path: str) -> dict[str, Any]:
    """`load` from a checkpoint already opened (`open_checkpoint(path)`): the Checkpointer reads
    the step's index once for its templates and for the load."""
    index, fetcher = loadable(opened)
    leaves = flatten(state_dict, lambda v: isinstance(v, torch.Tensor))
    keys = _keys_in(index, state_dict, [key_of(p) for p, _ in leaves])
    missing = [k for k in keys if k not in index.tensors and k not in index.objects]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise FormatError(
            f"{path}: has no {shown} (the checkpoint holds {len(index.tensors)} tensors, e.g. "
            f"{', '.join(list(index.tensors)[:3])})"
        )
    # every refusal before the first byte is copied: a refused load leaves the state dict as it was
    targets = [(path_, value, _target(value, index, key, path)) for (path_, value), key in zip(leaves, keys)]
    for (path_, value, target), key in zip(targets, keys):
        if target is None:
            _set(state_dict, path_, index.objects[key].value)
        else:
            _fill(*target, index.tensors[key], fetcher)
    return state_dict


def _keys_in(index: CheckpointIndex, state_dict: Mapping[str, Any], keys: list[str]) -> list[str]:
    """The checkpoint keys of a state dict's leaves: their own (DCP's flattening), or, for a bare
    model state dict (`model.state_dict()`, no "model" key of its own) whose every leaf the
    checkpoint holds under `model.`, those: a plain torch.save file or a DeepSpeed checkpoint is
    seen through convert's canonical state, which names the model's tensors `model.<fqn>`."""
    held = lambda k: k in index.tensors or k in index.objects  # noqa: E731
    if keys and "model" not in state_dict and not all(map(held, keys)):
        prefixed = ["model." + k for k in keys]
        if all(map(held, prefixed)):
            return prefixed
    return keys


def loadable(opened: Any, rules: Any = None) -> tuple[CheckpointIndex, Any]:
    """The index whose keys are the state dict's, and the fetcher that reads its tensors.
    `rules` (convert's KeyRules: --strip-prefix, --rename) rename the parameters: the checkpoint
    is then read through the canonical training state whatever its format."""
    from .convert.state import read_state
    from .convert.to_torch_layouts import fetcher_for, torch_recipe_index
    from .formats.registry import capabilities_of
    from .runner.fetch import Fetcher

    if rules is None and capabilities_of(opened.index).recipe_keys:  # DCP: its keys are the state dict's
        return opened.index, Fetcher(opened.source, index=opened.index)
    state = read_state(opened, rules)
    index, resolver = torch_recipe_index(state, "load")
    return index, fetcher_for(state, resolver)


def _target(value: Any, index: CheckpointIndex, key: str, path: str) -> tuple[torch.Tensor, Box] | None:
    """The local tensor and box a tensor leaf is filled into (None for a value the checkpoint's
    replaces); an error naming `key` where the two do not fit. torch's dcp.load refuses a
    checkpoint tensor for a leaf that is no tensor too, and would leave a meta tensor empty."""
    entry = index.tensors.get(key)
    if not isinstance(value, torch.Tensor):
        if entry is not None:
            raise FormatError(
                f"{path}: {key} is a tensor in the checkpoint, the state dict holds "
                f"{type(value).__name__} (put a tensor of shape {list(entry.shape)} there to load it)"
            )
        return None
    if entry is None:
        raise FormatError(f"{path}: {key} is not a tensor in the checkpoint")
    if tuple(value.shape) != tuple(entry.shape):
        raise FormatError(
            f"{path}: {key} has shape {list(entry.shape)} in the checkpoint, the state dict expects {list(value.shape)}"
        )
    local, box = _local_box(value)
    if local.is_meta:
        raise UsageError(
            f"{key} is a tensor on the meta device, which holds no data to load into: "
            f"materialise the model first (model.to_empty(device=...)), then load"
        )
    return local, box


def _fill(local: torch.Tensor, box: Box, entry: TensorEntry, fetcher: Any) -> None:
    """Copy the checkpoint's `box` of `entry` into `local`."""
    if local.numel() == 0:
        return
    with torch.no_grad():
        if local.device.type == "cpu" and local.dtype == torch_dtype(entry.dtype) and local.is_contiguous():
            fetcher.fetch(entry, box, out=local.detach())  # read straight into the shard: no buffer, no copy
            return
        buf = fetcher.fetch(entry, box)  # in the checkpoint's dtype; copy_ casts (as dcp.load does)
        local.copy_(buf.reshape(local.shape))


def _local_box(t: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """The local tensor to fill and the box of the global tensor it holds."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4 layout
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if tuple(local.shape) != tuple(shape):
            raise UnsupportedError(
                f"DTensor with placements {t.placements} keeps a padded local shard "
                f"{tuple(local.shape)}; ckptkit.load fills unpadded shards only"
            )
        return local, Box(tuple(offset), tuple(shape))
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise UnsupportedError(f"ckptkit.load fills plain tensors and DTensors, not {type(t).__name__}")
    return t, Box.whole(tuple(t.shape))


def _set(root: Any, path: tuple, value: Any) -> None:
    node = root
    for part in path[:-1]:
        node = node[part] if not isinstance(node, list) else node[int(part)]
    last = path[-1]
    if isinstance(node, list):
        node[int(last)] = value
    elif isinstance(node, dict) and last not in node and str(last) in node:
        node[str(last)] = value
    else:
        node[last] = value


__all__ = ["save", "load"]
