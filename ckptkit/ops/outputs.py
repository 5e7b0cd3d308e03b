"""Where an output goes: OUT is a folder, or, when its name says so, the one file itself.

`convert --to torch model.pt` writes the file model.pt (as torch's format_utils does), and an OUT
ending in .safetensors is that file when the model fits in one shard. A trailing slash always
means a folder."""

from __future__ import annotations

from ..errors import UsageError
from ..formats.protocols import OutTensor
from ..formats.registry import format_named

TORCH_FILE_SUFFIXES = (".pt", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"


def file_output(out: str, target: str) -> bool:
    """True when OUT names the single file to write (model.pt for torch, x.safetensors)."""
    name = out.rstrip("/").lower()
    if out.endswith("/"):
        return False
    if target == "torch":
        return name.endswith(TORCH_FILE_SUFFIXES)
    return target == "safetensors" and name.endswith(SAFETENSORS_SUFFIX)


def single_file_shards(out: str, tensors: list[OutTensor], max_shard_bytes: int, hint: str = "") -> None:
    """A .safetensors OUT holds the model in one file: refuse one that would need shards."""
    count = format_named("safetensors").shard_count(tensors, max_shard_bytes)
    if count > 1:
        raise UsageError(
            f"{out}: the model needs {count} shards of at most {max_shard_bytes} bytes, so it "
            f"cannot be one .safetensors file; give a folder as OUT{hint}"
        )
