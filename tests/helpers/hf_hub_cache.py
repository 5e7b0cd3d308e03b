"""A Hugging Face hub cache as huggingface_hub lays one out (snapshot files linking into blobs/),
holding a small sharded safetensors model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def hf_cache(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """models--org--tiny/{blobs/<sha256>, refs/main, snapshots/<rev>/* -> ../../blobs/<sha256>},
    as huggingface_hub lays it out: a sharded safetensors model, its index and a config."""
    import json

    from safetensors.torch import save_file

    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, rev = repo / "blobs", "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    gen = torch.Generator().manual_seed(0)
    shards = {
        "model-00001-of-00002.safetensors": {"embed.weight": torch.randn(8, 4, generator=gen)},
        "model-00002-of-00002.safetensors": {
            "head.weight": torch.randn(3, 4, generator=gen),
            "head.bias": torch.randn(3, generator=gen),
        },
    }
    staging = tmp_path / "staging"
    staging.mkdir()
    files = {}
    for name, tensors in shards.items():
        save_file(tensors, str(staging / name))
        files[name] = (staging / name).read_bytes()
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, t in shards.items() for k in t}}
    ).encode()
    files["config.json"] = b'{"model_type": "tiny"}'
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / sha)
    return snap, {k: v for t in shards.values() for k, v in t.items()}
