"""An index and the chunks a DCP writer wrote for it, of any size: the input of the `.metadata`
pickle writer (formats/dcp/metadata_pickle)."""

from __future__ import annotations

from ckptkit.formats.dcp.writer import _Written
from ckptkit.index.types import Box, CheckpointIndex, TensorEntry

SAVE_ID = "0123456789abcdef0123456789abcdef"


def many_written(n_tensors: int, chunks: int, shape=(8, 4), dtype="float32", **kw):
    index = CheckpointIndex(format="dcp", root="x")
    written = []
    for t in range(n_tensors):
        key = f"model.layers.{t}.w"
        index.add_tensor(TensorEntry(key, dtype, shape, [], path=tuple(key.split(".")), **kw))
        rows = shape[0] // chunks if shape else 0
        for c in range(chunks):
            box = Box((c * rows,) + (0,) * (len(shape) - 1), (rows,) + tuple(shape[1:])) if shape else Box((), ())
            written.append(_Written(key, box, f"__{c}_0.distcp", t * 1000 + c, 900))
    return index, written
