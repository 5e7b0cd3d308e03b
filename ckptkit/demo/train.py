"""A real, tiny FSDP2 training run on CPU (gloo) that saves a DCP checkpoint with AdamW state.

Used by `ckptkit demo`; it needs only torch. Each worker process trains the same small model
sharded with fully_shard, then saves {"model", "optim", "extra"} through dcp.save.
"""

from __future__ import annotations

import os
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 50))


def _worker(rank: int, world_size: int, port: int, out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    import warnings

    warnings.filterwarnings("ignore")  # torch's FSDP2/DCP notices are not the demo's subject
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = build_model()
        for layer in (model[1], model[4]):
            fully_shard(layer)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            tokens = torch.randint(0, 50, (8, 12), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 50), tokens.reshape(-1))
            loss.backward()
            optim.step()
            optim.zero_grad()
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd, "extra": {"step": steps, "loss": float(loss)}}, checkpoint_id=out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_and_save(out: str, world_size: int = 2, steps: int = 3) -> None:
    """Spawn `world_size` CPU processes that train with FSDP2 and save a DCP checkpoint to `out`."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world_size, _free_port(), out, steps), nprocs=world_size, join=True)
