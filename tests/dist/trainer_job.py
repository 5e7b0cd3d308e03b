"""One Hugging Face Trainer run on CPU (torchrun, gloo): train, or resume from a checkpoint folder.

    torchrun --nproc_per_node N tests/dist/trainer_job.py --layout ds_z2|ds_z3|fsdp1|fsdp2|fsdp2_full|ddp \
        --output-dir DIR --max-steps S [--save-steps K] [--resume CHECKPOINT] --result R.json \
        [--logits L.pt]

The model is a tiny LlamaForCausalLM built from a LlamaConfig (nothing downloaded); every training
sample is the same sequence, so the logged loss does not depend on how samples fall on ranks and a
resume at another world size must log the same loss as one at the original size.
  ds_z2   DeepSpeed ZeRO-2, bf16, NO optimizer section: the Trainer passes torch's AdamW
  ds_z3   DeepSpeed ZeRO-3, bf16 (optimizer section: DeepSpeed's own Adam)
  fsdp1   FSDP1 through accelerate, SHARDED_STATE_DICT (fp32, use_orig_params)
  fsdp2   FSDP2 through accelerate, SHARDED_STATE_DICT (fp32)
  fsdp2_full  FSDP2 through accelerate, FULL_STATE_DICT: pytorch_model_fsdp.bin, optimizer.bin
  ddp     plain DDP (fp32): the checkpoint is model.safetensors and optimizer.pt
  accel_fsdp2  no Trainer: accelerate's own loop with FSDP2, SHARDED_STATE_DICT, torch's AdamW and
          a constant LambdaLR; accelerator.save_state(OUTPUT_DIR/checkpoint-<max steps>) at the end,
          accelerator.load_state(RESUME) to resume
Rank 0 writes --result: the losses logged per step, the final global step, the world size and
whether the model was really sharded. --logits: the trained model's fp32 weights (DeepSpeed's
master weights, FSDP's full parameters) loaded into a plain LlamaForCausalLM, its logits on a fixed
input saved by rank 0 (truth for consolidate).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

SEQ = 16
VOCAB = 64
SAMPLES = 96
LR = 1e-2


def model_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                       tie_word_embeddings=False, use_cache=False)


def fixed_input() -> torch.Tensor:
    return (torch.arange(SEQ) * 7 % VOCAB).unsqueeze(0)


class Same(torch.utils.data.Dataset):
    """SAMPLES copies of one sequence (labels = inputs)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        ids = fixed_input()[0]
        return {"input_ids": ids.clone(), "labels": ids.clone()}


def ds_config(stage: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    if stage == 3:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                        "betas": "auto", "eps": "auto", "torch_adam": True}}
        cfg["zero_optimization"].update({"stage3_gather_16bit_weights_on_model_save": False})
    return cfg


def training_args(layout: str, out: str, max_steps: int, save_steps: int):
    from transformers import TrainingArguments

    common = dict(output_dir=out, max_steps=max_steps, save_steps=save_steps, save_strategy="steps",
                  logging_steps=1, per_device_train_batch_size=2, learning_rate=LR,
                  lr_scheduler_type="constant", seed=7, data_seed=7, report_to=[], disable_tqdm=True,
                  dataloader_num_workers=0)
    if layout.startswith("ds_"):
        return TrainingArguments(**common, deepspeed=ds_config(int(layout[-1])), bf16=True, use_cpu=True)
    if layout == "ddp":
        return TrainingArguments(**common, use_cpu=True)
    fsdp = {"version": 1, "state_dict_type": "SHARDED_STATE_DICT", "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "sync_module_states": False}  # on True accelerate's plugin looks for an accelerator device
    if layout.startswith("fsdp2"):
        fsdp.update(version=2, reshard_after_forward=True)
    if layout == "fsdp2_full":
        fsdp.update(state_dict_type="FULL_STATE_DICT")
    return TrainingArguments(**common, use_cpu=True, fsdp=True, fsdp_config=fsdp)


def force_fsdp_on_cpu() -> None:
    """accelerate turns FSDP on only for accelerator device types and trains a CPU job with DDP
    instead; seen as a multi-GPU job (its device stays the CPU) it applies the FSDP plugin."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        # FSDP1 takes it as device_id, and refuses "cpu:0" for a module it computes on "cpu"
        PartialState._shared_state["device"] = torch.device("cpu")


def sharded(model, layout: str, total: int) -> bool:
    """Is the model really partitioned across ranks (not a DDP replica)? `total`: its element count."""
    if layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return isinstance(model, FSDP) and sum(p.numel() for p in model.parameters()) < total
    if layout.startswith("fsdp2"):
        from torch.distributed.tensor import DTensor

        return all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters())
    if layout == "ds_z3":
        return all(hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in model.parameters())
    return layout == "ds_z2"  # ZeRO-2 partitions the optimizer state (the stage is recorded); DDP: False


def full_fp32(trainer, layout: str) -> dict:
    """Every parameter's fp32 value as the trained job holds it (collective)."""
    model = trainer.model_wrapped
    out = {}
    inner = trainer.model
    if layout.startswith("ds_"):
        from deepspeed.utils import safe_get_full_fp32_param

        for name, p in inner.named_parameters():
            out[name] = safe_get_full_fp32_param(p).detach().clone().float()
    elif layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            for name, p in model.named_parameters():
                out[name.replace("_fsdp_wrapped_module.", "")] = p.detach().clone().float()
    elif layout == "ddp":
        for name, p in inner.named_parameters():
            out[name] = p.detach().clone().float()
    else:
        for name, p in model.named_parameters():
            out[name] = p.full_tensor().detach().clone().float()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True, choices=["ds_z2", "ds_z3", "fsdp1", "fsdp2", "fsdp2_full", "ddp",
                                                          "accel_fsdp2"])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--max-steps", type=int, required=True)
    ap.add_argument("--save-steps", type=int, default=1000)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--result", required=True)
    ap.add_argument("--logits", default=None)
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _checks import start_watchdog, write_result

    start_watchdog(900)
    if a.layout == "accel_fsdp2":
        return accelerate_main(a, write_result)
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, set_seed

    args = training_args(a.layout, a.output_dir, a.max_steps, a.save_steps)
    if a.layout.startswith("fsdp"):
        args.device  # accelerate's state is set up (and reset) here
        force_fsdp_on_cpu()
    set_seed(7)
    model = LlamaForCausalLM(model_config())
    total = sum(p.numel() for p in model.parameters())
    records: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                records.append({**logs, "step": state.global_step})

    trainer = Trainer(model=model, args=args, train_dataset=Same(), callbacks=[Record()])
    trainer.train(resume_from_checkpoint=a.resume)
    rank = int(os.environ.get("RANK", "0"))
    info = {"losses": {str(r["step"]): r["loss"] for r in records}, "global_step": trainer.state.global_step,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")), "layout": a.layout,
            "sharded": sharded(trainer.model_wrapped if a.layout.startswith("fsdp") else trainer.model, a.layout,
                               total),
            "distributed_type": str(trainer.accelerator.distributed_type)}
    if a.layout.startswith("ds_"):
        info["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
        info["optimizer"] = type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                                 else trainer.optimizer).__name__
        inner = getattr(trainer.model_wrapped, "optimizer", None)
        base = getattr(inner, "optimizer", inner)
        info["base_optimizer"] = type(base).__name__
    if a.logits:
        weights = full_fp32(trainer, a.layout)
        if rank == 0:
            plain = LlamaForCausalLM(model_config())
            missing, unexpected = plain.load_state_dict(weights, strict=False)
            assert not missing and not unexpected, (missing, unexpected)
            plain.eval()
            with torch.no_grad():
                logits = plain(fixed_input()).logits
            torch.save({"input_ids": fixed_input(), "logits": logits}, a.logits)
    if rank == 0:
        write_result(a.result, info)
    return 0


def accelerate_main(a, write_result) -> int:
    """accelerate without the Trainer: its save_state()/load_state() folder."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from transformers import LlamaForCausalLM, set_seed

    PartialState(cpu=True)
    force_fsdp_on_cpu()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
        cpu_ram_efficient_loading=False)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    set_seed(7)
    model = LlamaForCausalLM(model_config())
    total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    loader = torch.utils.data.DataLoader(Same(), batch_size=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    start = 0
    if a.resume:
        accelerator.load_state(a.resume)
        start = accelerator.step
    losses = {}
    batches = iter(loader)
    for step in range(start + 1, a.max_steps + 1):
        batch = next(batches)
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.step = step
        losses[str(step)] = accelerator.reduce(loss.detach(), "mean").item()
    if not a.resume:
        accelerator.save_state(os.path.join(a.output_dir, f"checkpoint-{a.max_steps}"))
    info = {"losses": losses, "global_step": a.max_steps, "resumed_at": start, "layout": a.layout,
            "world_size": accelerator.num_processes, "sharded": sharded(model, "fsdp2", total),
            "distributed_type": str(accelerator.distributed_type)}
    if a.logits:
        weights = full_fp32_of(model)
        if accelerator.is_main_process:
            save_logits(weights, a.logits)
    if accelerator.is_main_process:
        write_result(a.result, info)
    return 0


def full_fp32_of(model) -> dict:
    return {name: p.full_tensor().detach().clone().float() for name, p in model.named_parameters()}


def save_logits(weights: dict, path: str) -> None:
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM(model_config())
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    plain.eval()
    with torch.no_grad():
        logits = plain(fixed_input()).logits
    torch.save({"input_ids": fixed_input(), "logits": logits}, path)


if __name__ == "__main__":
    code = main()
    import torch.distributed as dist

    if dist.is_initialized():
        # like every job here: a final barrier, then os._exit. Tearing gloo down at interpreter exit
        # (destroy_process_group, then sys.exit) aborted a rank now and then when the machine was busy
        # ("terminate called without an active exception", SIGABRT) after the job had done its work.
        from _checks import leave

        leave(code)
    sys.exit(code)
