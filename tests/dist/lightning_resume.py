"""Lightning resumes a checkpoint ckptkit rewrote, at another world size, with its own Trainer.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node M tests/dist/lightning_resume.py \
        --strategy fsdp|deepspeed --ckpt DIR --truth TRUTH.pt --result OUT.json

The LightningModule, data and CPU strategies are the fixture generator's
(fixtures/generate_lightning.py), so the run is the one that wrote the fixture, now at M
processes: ``Trainer.fit(module, data, ckpt_path=DIR)`` with max_steps = the checkpoint's step + 1.
Lightning restores the model, the optimizer, the scheduler and its loops from DIR through its own
strategy (FSDPStrategy.load_checkpoint: DCP + meta.pt; DeepSpeedStrategy.load_checkpoint: the
engine's load_checkpoint and the client state). At ``on_train_start`` (after the restore, before
any step) rank 0 compares, bit for bit, with TRUTH (a dict the test wrote from Lightning's own
reading of the source):
  state_dict   every model tensor (FSDP: get_state_dict(full_state_dict); DeepSpeed:
               safe_get_full_fp32_param)
  optim        every optimizer state tensor by parameter name (FSDP: get_state_dict; DeepSpeed:
               safe_get_full_optimizer_state, exp_avg and exp_avg_sq; its step is an int of the engine)
  global_step, epoch, the scheduler's state_dict
Then one training step runs on every rank (finite loss, global_step + 1). Rank 0 writes
{"ok", "world_size", "compared", "mismatches", "global_step_restored", "global_step_end", "loss"}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))

import torch  # noqa: E402

import generate_lightning as gen  # noqa: E402


def bits_equal(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def gather(strategy: str, trainer, module) -> tuple[dict, dict]:
    """(model name -> full tensor, param name -> {state key: full tensor}), on rank 0."""
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(trainer.strategy.model, trainer.optimizers,
                                  options=StateDictOptions(full_state_dict=True))
        return dict(msd), {n: dict(s) for n, s in osd.get("state", {}).items()}
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = trainer.strategy.deepspeed_engine.optimizer  # ZeRO 1/2 link the state fragments lazily:
    opt._hp_optimizer_states_linked = False          # link them again after the load (as
    opt._lazy_init_hp_params_optimizer_state()       # generate_deepspeed.relink_optimizer_states does)
    model, optim = {}, {}
    for name, p in module.named_parameters():
        model[name] = safe_get_full_fp32_param(p)
        optim[name] = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
    return model, optim


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=("fsdp", "deepspeed"), required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--truth", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()

    import lightning.pytorch as pl

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    truth = torch.load(args.truth, weights_only=False)  # the test's own file
    found: dict = {"world_size": world, "compared": 0, "mismatches": []}

    class Check(pl.Callback):
        def on_train_start(self, trainer, module) -> None:
            found["global_step_restored"] = trainer.global_step
            model, optim = gather(args.strategy, trainer, module)
            if trainer.global_rank != 0:
                return
            bad = found["mismatches"]
            for name, want in truth["state_dict"].items():
                found["compared"] += 1
                if not bits_equal(model.get(name), want):
                    bad.append(f"model {name}")
            for name, states in truth["optim"].items():
                for key, want in states.items():
                    found["compared"] += 1
                    if not bits_equal(optim.get(name, {}).get(key), want):
                        bad.append(f"optim {name}.{key}")
            sched = trainer.lr_scheduler_configs[0].scheduler.state_dict()
            if sched != truth["lr_scheduler"]:
                bad.append(f"lr scheduler {sched} != {truth['lr_scheduler']}")
            if trainer.global_step != truth["global_step"]:
                bad.append(f"global_step {trainer.global_step} != {truth['global_step']}")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            found["loss"] = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)

    module = gen.build_module(1)
    strategy = gen.cpu_fsdp_strategy() if args.strategy == "fsdp" else gen.cpu_deepspeed_strategy()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=truth["global_step"] + 1,
                         max_epochs=truth["epoch"] + 2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         deterministic=True, callbacks=[Check()],
                         default_root_dir=str(Path(args.result).parent / "lightning_root"))
    trainer.fit(module, gen.data(world), ckpt_path=args.ckpt)
    found["global_step_end"] = trainer.global_step
    if trainer.is_global_zero:
        loss = found.get("loss")
        found["ok"] = bool(found["compared"] and not found["mismatches"] and loss is not None and math.isfinite(loss)
                           and found["global_step_end"] == truth["global_step"] + 1)
        Path(args.result).write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
