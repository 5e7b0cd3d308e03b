"""`LazyTensor`: a tensor of the index that a writer streams at write time, never loaded first.

Writers and the layouts they are handed (convert's ZeRO target, the DeepSpeed cells, the DCP and
safetensors items) put one wherever a file holds a tensor; the torch.save archive writer
(formats/torch_save/archive_writer.py) streams its bytes from the entry's pieces. It lives here,
beside the entries it wraps, so that code above the formats can build a layout without
reaching into a format package.
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import TensorEntry


@dataclass(eq=False)
class LazyTensor:
    """A tensor written from `entry`'s pieces at archive time (contiguous, `entry.shape`)."""

    entry: TensorEntry
