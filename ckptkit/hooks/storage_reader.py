"""`ckptkit.StorageReader(path)`: torch's `dcp.load` reading any checkpoint ckptkit reads.

Training stacks call `torch.distributed.checkpoint.load` themselves and take a StorageReader,
torch's extension point for where the bytes come from. This one opens the checkpoint with
ckptkit's readers (the restricted unpickler, the limits, the one-sentence errors) and presents it
to torch's planner as a DCP checkpoint: keys follow convert's rules (`model.<fqn>`,
`optim.state.<fqn>.<what>`, `optim.param_groups.<g>.<hyper>`, a DeepSpeed checkpoint through the
canonical training state), each tensor one chunk as large as the tensor. torch's planner cuts each
rank's share out of that chunk, and `read_data` reads exactly that box from ckptkit's pieces, so
a rank reads only its own byte ranges.

The checkpoint is opened when the reader is made (or reset to another path), outside torch's
collectives: a bad checkpoint is ckptkit's own error on every rank, not a CheckpointException.
An error inside `dcp.load` (a file that changed since, a key the checkpoint lacks) is wrapped by
torch; `unwrap` turns it back into ckptkit's sentence, and `load` does so itself.
"""

from __future__ import annotations

import io
import os
import uuid
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..api import loadable
from ..convert.names import KeyRules
from ..errors import FormatError
from ..index.dtypes import torch_dtype
from ..index.types import Box, CheckpointIndex, TensorEntry
from .dcp_errors import unwrap_exception
from .reader_detect import readable
from ..storage.source import path_text
from .reader_keys import MODEL, OPTIM, check_prefix, presented_names


class StorageReader(dcp.StorageReader):
    """A `torch.distributed.checkpoint.StorageReader` over every checkpoint format ckptkit reads.

    `dcp.load(state_dict, storage_reader=ckptkit.StorageReader(path))` fills a (sharded) state
    dict from DeepSpeed ZeRO, DCP, FSDP, torch.save, safetensors, trainer and run folders, at any
    world size. Options: `strip_prefix` and `rename` (OLD=NEW) change parameter names as convert's
    --strip-prefix and --rename do; `add_prefix` as --add-prefix; `model_prefix` and
    `optim_prefix` name the containers the state dict keeps the model and the optimizer under
    ("model." and "optim." as `get_state_dict` under {"model", "optim"}; torchtitan: "" and
    "optimizer."); `tag` picks a DeepSpeed tag; `follow_links` lets a local checkpoint's links
    lead outside it (docs/integrations.md)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        tag: str | None = None,
        follow_links: bool | None = None,
        strip_prefix: str | tuple[str, ...] | list[str] = (),
        rename: str | tuple[str, ...] | list[str] = (),
        add_prefix: str = "",
        model_prefix: str = MODEL,
        optim_prefix: str = OPTIM,
    ) -> None:
        super().__init__()
        self.model_prefix = check_prefix("model_prefix", model_prefix)
        self.optim_prefix = check_prefix("optim_prefix", optim_prefix)
        strip = (strip_prefix,) if isinstance(strip_prefix, str) else tuple(strip_prefix)
        renames = KeyRules.parse_renames((rename,) if isinstance(rename, str) else tuple(rename))
        self.rules = KeyRules(strip, renames, add_prefix) if strip or renames or add_prefix else None
        if self.rules is None and (model_prefix, optim_prefix) != (MODEL, OPTIM):
            self.rules = KeyRules()  # through the canonical state, whose containers are model./optim.
        self.tag, self.follow_links = tag, follow_links
        self.path = ""
        self._open(path)

    def _open(self, checkpoint_id: str | os.PathLike) -> None:
        """Index the checkpoint at `checkpoint_id` (every rank, outside torch's collectives)."""
        from ..formats.registry import open_checkpoint

        path = path_text(checkpoint_id, "ckptkit.StorageReader")
        opened = open_checkpoint(path, tag=self.tag, follow_links=self.follow_links)
        self.index, self.fetcher = loadable(opened, self.rules)
        self.names = presented_names(self.index, self.model_prefix, self.optim_prefix)
        self.path = path
        self._metadata: Metadata | None = None
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        """The path read (torch logs it)."""
        return self.path

    # --- torch's StorageReader protocol -------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new read; another `checkpoint_id` opens that checkpoint instead."""
        same = isinstance(checkpoint_id, (str, os.PathLike)) and os.fspath(checkpoint_id) == self.path
        if checkpoint_id is not None and not same:
            self._open(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint as DCP metadata: one chunk per tensor, a bytes item per other value."""
        if self._metadata is None:
            self._metadata = metadata_of(self.index, self.names)
        self._metadata.storage_meta = StorageMeta(checkpoint_id=self.path, load_id=self.load_id)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the index was read when the reader was made."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each item's box read from the checkpoint's pieces straight into the state dict's tensor;
        each value re-pickled from what the restricted unpickler rebuilt (torch's planner unpickles
        bytes items with weights_only=False: the checkpoint's own bytes never reach it)."""
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._value_bytes(item.storage_index.fqn))
            else:
                self._read_tensor(item, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True where ckptkit recognises a checkpoint at `checkpoint_id` (a look at names and
        headers, nothing indexed), so torch's automatic reader selection can be pointed here."""
        return readable(checkpoint_id)

    # --- ckptkit's side -----------------------------------------------------------------------

    def load(self, state_dict: dict[str, Any], **kwargs: Any) -> None:
        """`dcp.load(state_dict, storage_reader=self, **kwargs)`, torch's wrapped errors raised
        as ckptkit's sentence."""
        try:
            dcp.load(state_dict, storage_reader=self, **kwargs)
        except BaseException as exc:  # CheckpointException is a BaseException
            unwrapped = self.unwrap(exc)
            if unwrapped is exc:
                raise
            raise unwrapped from None

    def unwrap(self, exc: BaseException) -> BaseException:
        """The ckptkit error inside torch's CheckpointException (a key the checkpoint lacks and a
        shape that differs worded as ckptkit words them); any other exception as is."""
        return unwrap_exception(exc, self.path, [n for n, k in self.names.items() if k in self.index.tensors])

    def _value_bytes(self, name: str) -> io.BytesIO:
        key = self.names.get(name, name)
        entry = self.index.objects.get(key)
        if entry is None:  # the metadata listed it: only a changed index gets here
            raise FormatError(f"{self.path}: has no value {key}")
        buf = io.BytesIO()
        torch.save(entry.value, buf)
        buf.seek(0)
        return buf

    def _read_tensor(self, item: ReadItem, planner: LoadPlanner) -> None:
        key = item.storage_index.fqn
        entry = self.index.tensors.get(self.names.get(key, key))
        if entry is None:
            raise FormatError(f"{self.path}: has no tensor {key}")
        box = Box(tuple(item.storage_offsets), tuple(item.lengths))
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != box.sizes:
            raise FormatError(
                f"{self.path}: {key}: the state dict's region has shape {list(target.shape)}, "
                f"the checkpoint's {list(box.sizes)}"
            )
        fill(target, entry, box, self.fetcher)
        planner.commit_tensor(item, target)


def fill(target: torch.Tensor, entry: TensorEntry, box: Box, fetcher: Any) -> None:
    """Copy `box` of `entry` into `target`: straight into it where it is a plain CPU tensor of the
    checkpoint's dtype, else through a buffer of the box (copy_ casts, as dcp.load does)."""
    if target.numel() == 0:
        return
    with torch.no_grad():
        if target.device.type == "cpu" and target.dtype == torch_dtype(entry.dtype) and target.is_contiguous():
            fetcher.fetch(entry, box, out=target)
            return
        target.copy_(fetcher.fetch(entry, box).reshape(target.shape))


def metadata_of(index: CheckpointIndex, names: dict[str, str]) -> Metadata:
    """DCP metadata for `index` under the shown `names` (name -> index key): each tensor a single
    whole-tensor chunk, each other value a bytes item."""
    md: dict[str, Any] = {}
    for name, key in names.items():
        entry = index.tensors.get(key)
        if entry is None:
            md[name] = BytesStorageMetadata()
            continue
        shape = torch.Size(entry.shape)
        md[name] = TensorStorageMetadata(
            TensorProperties(dtype=torch_dtype(entry.dtype)),
            shape,
            [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
        )
    return Metadata(state_dict_metadata=md)


__all__ = ["StorageReader"]
