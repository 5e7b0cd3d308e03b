"""Write an index as one torch.save file, streaming tensors (see archive_writer).

Nesting is rebuilt from each entry's path; tensors that share bytes in the source (tied weights)
share one storage in the output, as in the original file.
"""

from __future__ import annotations

from ...context import RunContext
from ...index.flatten import unflatten
from ...index.types import CheckpointIndex
from ...runner.executor import run_jobs
from ...runner.fetch import Fetcher
from ...runner.stream import find_aliases
from ...storage.commit import Output
from .archive_writer import LazyTensor, write_archive


def write_torch_save(
    out: Output,
    name: str,
    index: CheckpointIndex,
    fetcher: Fetcher,
    *,
    ctx: RunContext,
    keys: list[str] | None = None,
    include_objects: bool = True,
    key_map: dict[str, tuple] | None = None,
) -> None:
    """Write index tensors (and objects) as one torch.save file `name` in `out`."""
    keys = list(index.tensors) if keys is None else keys
    aliases = find_aliases({k: index.tensors[k] for k in keys})
    lazy = {k: LazyTensor(index.tensors[k]) for k in keys if k not in aliases}
    items = []
    for key in keys:
        e = index.tensors[key]
        path = (key_map or {}).get(key) or (tuple(e.path) if e.path else (key,))
        items.append((path, lazy[aliases.get(key, key)]))
    if include_objects:
        for obj in index.objects.values():
            items.append(((key_map or {}).get(obj.key) or (tuple(obj.path) if obj.path else (obj.key,)), obj.data))
    structure = unflatten(items)
    run_jobs(
        [lambda: write_archive(out, name, structure, fetcher, slab_bytes=ctx.slab_bytes, progress=ctx.progress)],
        1,
        group=out.group,
    )
