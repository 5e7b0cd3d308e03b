"""The real DeepSpeed checkpoint the ZeRO benchmarks measure, written by DeepSpeed itself.

bench_zero3.py, bench_universal.py and run.py time ckptkit on the same kind of source: a stack of
Linear layers trained one step by DeepSpeed on 2 CPU ranks (gloo), bf16, AdamW, saved as
global_step1; only the ZeRO stage and the size differ. One writer keeps them measuring the same thing.
"""

from __future__ import annotations

import os
import subprocess
import sys

_WRITER = r"""
import os, sys, torch, deepspeed
layers, width, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "train_batch_size": 2 * int(os.environ["WORLD_SIZE"]),
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": False}},
          "bf16": {"enabled": True}, "zero_optimization": {"stage": ZERO_STAGE}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x = torch.randn(2, width, dtype=torch.bfloat16)
engine.backward(engine(x).float().square().mean())
engine.step()
engine.save_checkpoint(out, tag="global_step1")
torch.distributed.barrier()
os._exit(0)
"""


def writer_script(stage: int) -> str:
    """The training script (argv: layers, width, output folder) that saves a ZeRO-`stage` checkpoint."""
    return _WRITER.replace("ZERO_STAGE", str(stage))


def write_zero_checkpoint(src: str, work: str, stage: int, layers: int, width: int, env: dict) -> None:
    """Train and save the checkpoint into `src` (2 ranks through torchrun; the script goes to
    `work`/writer.py) with `env` on top of this process's environment."""
    script = os.path.join(work, "writer.py")
    with open(script, "w") as f:
        f.write(writer_script(stage))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, str(layers), str(width), src]
    subprocess.run(cmd, check=True, env={**os.environ, **env})
