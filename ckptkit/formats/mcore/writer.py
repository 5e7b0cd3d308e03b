"""Write a Megatron-Core torch_dist checkpoint for a target layout (reshard --to tp=..,pp=..).

The global tensors are the same at every layout (layout_target.py), so the source's tensors are
written as they are, chunked as MCore's save would chunk them at the target, by DCP's writer
(formats/dcp/writer.py): `.metadata` plus one `__<rank>_0.distcp` per rank. Beside them, as
`dist_checkpointing.save` and Megatron-LM write them: `metadata.json`, `common.pt` (the source's
common state with the `args` sizes rewritten, so Megatron-LM sees the layout it was saved at) and,
for a save root, `latest_checkpointed_iteration.txt`.

`.metadata` has no `all_local_plans`: MCore reads it only to reuse a save plan when it saves
again (its load never does). Per-rank RNG states (`rng_state`) belong to the ranks of the old
layout; at a new tp or pp they are left out, as Megatron-LM itself ignores them on such a load
(load with --no-load-rng).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ...context import RunContext
from ...index.types import Box, CheckpointIndex, Piece, TensorEntry
from ...repickle import stand_in
from ...runner.fetch import Fetcher
from ...runner.torch_archive import load_structure, open_archive, tensor_location
from ...safeload import Inert, TensorRef, public_state_of
from ...storage.source import Source
from ..dcp.writer import write_dcp
from ..torch_save.archive_writer import LazyTensor, write_archive
from .args import NAMESPACE, fields_of
from .layout_target import McoreLayout, mcore_layout
from .reader import COMMON, LATEST, METADATA_JSON

RNG_STATE = "rng_state/"
METADATA_TEXT = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}  # fmt: skip
ARGS_SIZES = {  # args field -> the McoreLayout size it records
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "data_parallel_size": "dp",
}


@dataclasses.dataclass(frozen=True)
class McoreTarget:
    """What the MCore writer is given: the index and its source, the layout, where to write."""

    index: CheckpointIndex
    source: Source
    layout: McoreLayout
    iteration_folder: str | None  # the save root's iter_NNNNNNN (None: OUT is the iteration folder)
    keep_rng: bool  # the per-rank RNG states fit the target (same tp and pp)
    ep: int = 1
    model_only: bool = False  # common.pt's optimizer entries left out too


class _Prefixed:
    """An output seen from one of its folders (a save root's iteration folder)."""

    def __init__(self, out: Any, prefix: str) -> None:
        self._out, self._prefix, self.group = out, prefix, out.group

    def open(self, rel: str):
        return self._out.open(self._prefix + rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._out.write_bytes(self._prefix + rel, data)


def is_common(file: str | None) -> bool:
    return file is not None and (file == COMMON or file.endswith("/" + COMMON))


def _dcp_part(target: McoreTarget) -> tuple[CheckpointIndex, list[str], list[str]]:
    """The items of the .distcp files (common.pt's left out), keyed as MCore's planner keys them."""
    index = target.index
    part = CheckpointIndex(format="dcp", root=index.root, world_size=target.layout.world_size)
    for key, entry in index.tensors.items():
        if not any(is_common(p.location.file) for p in entry.pieces if p.location is not None):
            part.tensors[key] = dataclasses.replace(entry, path=(key,))
    for key, obj in index.objects.items():
        if obj.location is None or is_common(obj.location.file):
            continue
        if key.startswith(RNG_STATE) and not target.keep_rng:
            continue
        part.objects[key] = dataclasses.replace(obj, path=(key,))
    return part, list(part.tensors), list(part.objects)


def write_mcore(target: McoreTarget, out: Any, ctx: RunContext) -> list[str]:
    """Write the iteration folder (and, for a save root, the file naming it); the files written."""
    prefix = f"{target.iteration_folder}/" if target.iteration_folder else ""
    inner = _Prefixed(out, prefix)
    part, keys, objects = _dcp_part(target)
    layout = mcore_layout(part, target.layout, keys, objects)
    files = write_dcp(inner, part, Fetcher(target.source, index=part), layout, ctx=ctx, source=target.source)
    write_archive(inner, COMMON, common_state(target), Fetcher(target.source), slab_bytes=ctx.slab_bytes)
    inner.write_bytes(METADATA_JSON, metadata_json(target))
    files += [COMMON, METADATA_JSON]
    files = [prefix + f for f in files]
    if target.iteration_folder:
        step = target.iteration_folder[len("iter_") :].lstrip("0") or "0"
        out.write_bytes(LATEST, ("release" if target.iteration_folder == "release" else step).encode())
        files.append(LATEST)
    return files


def metadata_json(target: McoreTarget) -> bytes:
    """The source's metadata.json when it has one (its content metadata kept), else MCore's."""
    for rel in target.index.files:
        if rel == METADATA_JSON or rel.endswith("/" + METADATA_JSON):
            return target.source.read(rel, 0, target.source.size(rel))
    return json.dumps(METADATA_TEXT).encode()


def common_file(index: CheckpointIndex) -> str | None:
    return next((rel for rel in index.files if is_common(rel)), None)


def common_state(target: McoreTarget) -> Any:
    """common.pt's structure: the source's, its tensors streamed from it and `args` rewritten for
    the target layout; or, for a source without one, what Megatron-LM's loader reads."""
    rel = common_file(target.index)
    if rel is None:
        return {"args": new_args(target), "checkpoint_version": 3.0, "iteration": target.index.step or 0}
    archive = open_archive(target.source, rel)
    structure = load_structure(archive, eager=False)

    def lazy(value: Any, path: str) -> Any:
        if isinstance(value, TensorRef):
            dtype, loc = tensor_location(archive, value, path)
            shape = tuple(value.size)
            return LazyTensor(TensorEntry(path, dtype, shape, [Piece(Box.whole(shape), loc)]))
        if isinstance(value, dict):
            return type(value)((k, lazy(v, f"{path}.{k}")) for k, v in value.items())
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(lazy(v, f"{path}.{i}") for i, v in enumerate(value))
        return value

    state = lazy(structure, "common")
    if isinstance(state, dict) and fields_of(state.get("args")) is not None:
        state["args"] = rewritten_args(state["args"], target)
    if isinstance(state, dict) and target.model_only:
        state.pop("optimizer", None)
    return state


def rewritten_args(args: Inert, target: McoreTarget) -> Inert:
    """Megatron-LM's args with the parallel sizes (and world size) of the target."""
    fields = dict(public_state_of(args))
    sizes = {"tp": target.layout.tp, "pp": target.layout.pp, "dp": target.layout.dp}
    for name, size in ARGS_SIZES.items():
        fields[name] = sizes[size]
    if "expert_model_parallel_size" in fields:
        fields["expert_model_parallel_size"] = target.ep
    fields["world_size"] = target.layout.world_size
    return stand_in(NAMESPACE, **fields)


def new_args(target: McoreTarget) -> Inert:
    """The args Megatron-LM's loader reads back, for a source that kept none."""
    layout = target.layout
    return stand_in(
        NAMESPACE,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=target.ep,
        data_parallel_size=layout.dp,
        world_size=layout.world_size,
        num_layers=layout.num_layers,
        swiglu=layout.gated,
        ckpt_format="torch_dist",
        iteration=target.index.step or 0,
    )
