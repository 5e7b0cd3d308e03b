"""Multi-process check that DeepSpeed loads a tensor-parallel checkpoint at new tp and dp sizes.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node T*W tests/dist/ds_tp_load_check.py \
        --ckpt DIR --fixture NAME --tp T --result OUT.json

NAME is a fixture of fixtures/generate_ds_tp.py (truth: fixtures/data/ds_tp/NAME.truth.pt, or
ds_tp_uneven/ for its UNEVEN_FIXTURES: full tensors and each parameter's split). Every rank builds the fixture's model at tp T (the mpu model
of fixtures/ds_tp_models.py with MPU(T); an AutoTP fixture: LlamaForCausalLM, sharded by
DeepSpeed's AutoTP with autotp_size T when T > 1), its weights then overwritten from another seed (nothing passes by accident),
the fixture's DeepSpeed config with the batch re-derived for W = world / T, then:

1. ``engine.load_checkpoint(DIR)`` with optimizer and scheduler states;
2. on every rank, for every parameter: ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``
   (exp_avg, exp_avg_sq) and the module weight compared bit for bit (dtype, shape, torch.equal)
   with the truth's full tensor cut for this tp rank (ds_tp_models.slice_of; a parameter AutoTP cut
   unevenly: along its split at the sizes DeepSpeed's layer recorded, its partition_sizes); global_steps too;
3. one more training step (finite loss, global_steps advances).

Rank 0 writes {"ok", "world_size", "tp", "compared", "mismatches", "trained_step", "error"}.
Never hangs: process-group timeout, os._exit. tests/dist/ds_engine_cases.py runs it as one case of
a launch of several (check_case).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))

from _checks import join_verdicts, load_with_states, run_check  # noqa: E402  (tests/dist, next to this script)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--result", required=True)
    return ap.parse_args(argv)


def run(args: argparse.Namespace, rank: int, world: int) -> dict:
    """Load, compare and train one step (every rank); the result, complete on rank 0. Raises what
    fails (DeepSpeed refusing the checkpoint, a rank's error)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    import ds_tp_models as m
    import generate_ds_tp as gen

    tp = args.tp
    dp = world // tp
    kind, stage, dtype = gen.ALL_FIXTURES[args.fixture]
    autotp = kind.startswith("autotp")
    result: dict = {"ok": False, "world_size": world, "tp": tp, "compared": 0, "mismatches": [],
                    "trained_step": False, "error": None}
    mismatches: list[str] = []
    compared = 0
    truth = torch.load(gen.data_dir(args.fixture) / f"{args.fixture}.truth.pt", weights_only=False)
    cfg = gen.ds_config(kind, stage, dtype)
    # the batch DeepSpeed 0.19.8 checks: the mpu's dp; AutoTP at ZeRO 1/2 checks it against the whole world
    cfg["train_batch_size"] = m.MICRO_BATCH * (world if autotp and tp > 1 else dp)
    if autotp and tp > 1:
        cfg["tensor_parallel"]["autotp_size"] = tp
    else:
        cfg.pop("tensor_parallel", None)
    if kind == "mpu":
        mpu = m.MPU(tp)
        tp_rank = mpu.get_model_parallel_rank()
        model = m.make_model(tp, tp_rank, mpu.get_model_parallel_group())
        groups = m.param_groups(model)
    else:
        if stage == 3:
            raise RuntimeError("this check does not build an AutoTP model at ZeRO 3")
        from transformers import LlamaConfig, LlamaForCausalLM
        mpu, tp_rank = None, 0
        torch.manual_seed(m.MODEL_SEED)
        model = LlamaForCausalLM(LlamaConfig(**gen.llama_config(kind)))
        groups = model.parameters()
    g = torch.Generator().manual_seed(999)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg,
                                      mpu=mpu if tp > 1 else None)
    if autotp and tp > 1:
        from deepspeed.utils import groups as ds_groups
        tp_rank = ds_groups.get_tensor_model_parallel_rank()
    load_with_states(engine, args.ckpt)

    def check(what: str, got, want) -> None:
        nonlocal compared
        compared += 1
        got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape \
                or not torch.equal(got, want):
            desc = (f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) else repr(got))
            mismatches.append(f"rank {rank} (tp {tp_rank}): {what}: got {desc}, want {want.dtype} "
                              f"{list(want.shape)}")

    named = list(engine.module.named_parameters())
    def cut(pname, p):
        split, sizes = tuple(truth[f"split.{pname}"]), gen.partition_sizes(p) if tp > 1 else None
        if sizes and split[0] == "split":  # AutoTP's own sizes for this tp (uneven ones too)
            return lambda full: full.split(sizes, dim=split[1])[tp_rank].clone()
        return lambda full: m.slice_of(full, split, tp_rank, tp)

    cuts = {pname: cut(pname, p) for pname, p in named}
    for pname, p in named:
        check(f"fp32.{pname}", safe_get_full_fp32_param(p), cuts[pname](truth[f"fp32.{pname}"]))
        for key in ("exp_avg", "exp_avg_sq"):
            check(f"{key}.{pname}", safe_get_full_optimizer_state(p, key), cuts[pname](truth[f"{key}.{pname}"]))
    # ZeRO 3 partitions the module weights too: gathered over the data-parallel ranks to compare
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None, enabled=stage == 3):
        for pname, p in named:
            check(f"module.{pname}", p.data.clone(), cuts[pname](truth[f"module.{pname}"]))
    if int(engine.global_steps) != int(truth["global_steps"]):
        mismatches.append(f"rank {rank}: global_steps {engine.global_steps} != {truth['global_steps']}")
    before = int(engine.global_steps)
    if kind == "mpu":
        tokens, targets = m.make_batch()
        logits = engine(tokens)
        import torch.nn.functional as F
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    else:
        tokens, targets = m.make_batch(vocab=gen.llama_config(kind)["vocab_size"])
        loss = engine(input_ids=tokens, labels=targets).loss
    engine.backward(loss)
    engine.step()
    trained = math.isfinite(float(loss.detach())) and int(engine.global_steps) == before + 1
    return join_verdicts(result, world, compared, mismatches, trained)


def check_case(argv: list[str], rank: int, world: int) -> dict:
    """One case of a launch of several (tests/dist/ds_engine_cases.py): this script's options."""
    return run(parse_args(argv), rank, world)


def main() -> None:
    run_check(run, parse_args)


if __name__ == "__main__":
    main()
