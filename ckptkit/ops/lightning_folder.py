"""Commands on a Lightning FSDP sharded checkpoint folder as a unit (formats/lightning.py).

Lightning resumes such a folder (`Trainer.fit(ckpt_path=DIR)`, `FSDPStrategy.load_checkpoint`)
only with its `meta.pt` beside the DCP files. `reshard`, and `convert --to dcp` without options
that change names or state, write the same kind of folder: the DCP part laid out for the new
world size (its keys, `model` and `optimizer_<i>`, as they are), `meta.pt` and any other entry
of the folder copied byte for byte, each named in the summary (trainer_folder's machinery).
"""

from __future__ import annotations

from ..formats import lightning
from ..formats.protocols import DcpTarget
from ..formats.registry import Opened, format_named
from ..index.layouts import fsdp2_layout
from ..runner.fetch import Fetcher
from ..storage.output import open_output
from ..context import RunContext
from .trainer_folder import FolderResult, copy_tree

KIND, LAYOUT = "Lightning", "fsdp_sharded"
DCP_FILES = "the DCP files (.metadata, __<rank>_0.distcp)"


def is_folder(opened: Opened) -> bool:
    """A Lightning FSDP sharded checkpoint with its meta.pt: a folder written as a unit (only a DCP
    folder's reader adds a meta.pt, lightning.add_meta, so no format needs naming here)."""
    return bool(lightning.dcp_part(opened.index)[1])


def write_folder(opened: Opened, out: str, to: int, ctx: RunContext, src: str) -> FolderResult:
    """OUT as a Lightning FSDP folder for `to` ranks: the DCP part rewritten, the rest copied."""
    index, source = opened.index, opened.source
    part, copies = lightning.dcp_part(index, source)
    ctx.progress.start(part.total_tensor_bytes, f"reshard {index.world_size}->{to}")
    with open_output(out, overwrite=ctx.overwrite, group=ctx.group, sources=(src,)) as target:
        files = format_named("dcp").write(DcpTarget(part, Fetcher(source), fsdp2_layout(part, to), source), target, ctx)
        written = set(files)
        copied = copy_tree(source, target, copies[0], written)
        for name in copies[1:]:
            copy_tree(source, target, name, written)
    ctx.progress.close()
    unknown = [n + ("/" if source.isdir(n) else "") for n in copies[1:]]
    return FolderResult(
        out,
        LAYOUT,
        KIND,
        index.world_size,
        to,
        [DCP_FILES],
        copied,
        {},
        [],
        unknown,
        files + copied + copies[1:],
        len(part.tensors),
        part.total_tensor_bytes,
    )


def left_behind(opened: Opened, target: str) -> list[str]:
    """convert to another kind: what Lightning needs that the plain target does not hold, named."""
    index = opened.index
    info = index.metadata.get("lightning")
    layout = (info or {}).get("layout")
    if not info or target == "safetensors" or layout == "deepspeed" and target.startswith("zero"):
        return []  # safetensors lists what it did not write; DeepSpeed to DeepSpeed keeps the client state
    what = {
        "fsdp_sharded": "Lightning FSDP sharded folder (DCP files and meta.pt)",
        "deepspeed": "Lightning DeepSpeed folder (Lightning's keys as client state)",
        "single_file": "Lightning .ckpt (state_dict, optimizer_states, lr_schedulers, loops...)",
    }.get(layout, f"Lightning checkpoint ({layout})")
    carried = (
        "meta.pt's values (global_step, epoch, loops, callbacks, lr_schedulers...)"
        if info.get("meta") == lightning.META
        else "its other keys (global_step, epoch, loops, callbacks...)"
    )
    if lightning.META in index.metadata.get("unread", {}):
        carried = "meta.pt, which could not be read, is not carried"
    else:
        carried += " are carried as extras" + (" (client state)" if target.startswith("zero") else "")
    rest = ""
    if layout == "fsdp_sharded" and info.get("meta") == lightning.META:
        others = lightning.dcp_part(index, opened.source)[1][1:]
        rest = f"; not copied: {', '.join(others)}" if others else ""
    return [
        f"{what}: --to {target} writes a plain checkpoint, not a Lightning one, "
        f"which Lightning's Trainer does not resume from; {carried}{rest}"
    ]


__all__ = ["is_folder", "write_folder", "left_behind", "KIND", "LAYOUT"]
