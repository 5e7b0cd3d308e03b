"""Multi-process check that DeepSpeed loads a MoE + tensor-parallel checkpoint at new tp, ep and dp.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node T*W \
        tests/dist/ds_moe_tp_load_check.py --ckpt DIR --fixture NAME --tp T --ep E --result OUT.json \
        [--whole-experts]

NAME is a fixture of fixtures/generate_ds_moe_tp.py (truth: fixtures/data/ds_moe_tp/NAME.truth.pt,
full tensors under global expert names). Every rank builds fixtures/ds_moe_tp_models.py's model at
tp T and ep E with MPU(T) (--whole-experts: enable_expert_tensor_parallelism=False, the experts
whole and the ep rank DeepSpeed's legacy grouping gives, global rank % E), its weights then overwritten from another seed (nothing passes by
accident), the fixture's DeepSpeed config with the batch for W = world / T, then:

1. ``engine.load_checkpoint(DIR)`` with optimizer and scheduler states;
2. on every rank, for every parameter (local experts under their global ids: local + ep rank *
   experts per rank): ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state`` (exp_avg,
   exp_avg_sq) and the module weight compared bit for bit with the truth cut for this tp rank;
   global_steps too;
3. one more training step (finite loss, global_steps advances).

Rank 0 writes {"ok", "world_size", "tp", "ep", "compared", "mismatches", "trained_step", "error"}.
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
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--whole-experts", action="store_true",
                    help="MoE(enable_expert_tensor_parallelism=False): experts whole, ep rank = global rank % E")
    ap.add_argument("--truth", default=None, help="the truth file (default fixtures/data/ds_moe_tp/NAME.truth.pt)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace, rank: int, world: int) -> dict:
    """Load, compare and train one step (every rank); the result, complete on rank 0. Raises what
    fails (DeepSpeed refusing the checkpoint, a rank's error)."""
    import deepspeed
    import torch
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    import ds_moe_tp_models as m
    import generate_ds_moe_tp as gen

    tp, ep = args.tp, args.ep
    stage, dtype = gen.FIXTURES[args.fixture][:2]
    result: dict = {"ok": False, "world_size": world, "tp": tp, "ep": ep, "compared": 0, "mismatches": [],
                    "trained_step": False, "error": None}
    mismatches: list[str] = []
    compared = 0
    truth_path = args.truth or REPO / "fixtures" / "data" / "ds_moe_tp" / f"{args.fixture}.truth.pt"
    truth = torch.load(truth_path, weights_only=False)
    mpu = m.MPU(tp)
    expert_tp = not args.whole_experts
    model = m.make_model(tp, ep, mpu, expert_tp)
    tp_rank, dp_rank = mpu.get_model_parallel_rank(), mpu.get_data_parallel_rank()
    ep_rank = m.expert_parallel_rank(tp, ep, mpu, expert_tp)
    g = torch.Generator().manual_seed(999)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    cfg = gen.ds_config(stage, dtype, world // tp)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=m.param_groups(model), config=cfg, mpu=mpu)
    if ep_rank != groups._get_expert_parallel_rank(model.layers[0].mlp.expert_group_name):
        raise RuntimeError(f"rank {rank}: DeepSpeed's expert-parallel rank is not {ep_rank}")
    load_with_states(engine, args.ckpt)

    def check(what: str, got, want) -> None:
        nonlocal compared
        compared += 1
        got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape \
                or not torch.equal(got, want):
            desc = f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
            mismatches.append(f"rank {rank} (tp {tp_rank}, ep {ep_rank}): {what}: got {desc}, want "
                              f"{want.dtype} {list(want.shape)}")

    for pname, p in engine.module.named_parameters():
        gname = m.global_name(pname, ep_rank, m.NUM_EXPERTS // ep) if is_moe_param(p) else pname

        def cut(full):
            return m.slice_of(full, m.split_of(pname, expert_tp), tp_rank, tp)
        check(f"fp32.{gname}", safe_get_full_fp32_param(p), cut(truth[f"fp32.{gname}"]))
        for key in ("exp_avg", "exp_avg_sq"):
            check(f"{key}.{gname}", safe_get_full_optimizer_state(p, key), cut(truth[f"{key}.{gname}"]))
        check(f"module.{gname}", p.data.clone(), cut(truth[f"module.{gname}"]))
    if int(engine.global_steps) != int(truth["global_steps"]):
        mismatches.append(f"rank {rank}: global_steps {engine.global_steps} != {truth['global_steps']}")
    before = int(engine.global_steps)
    loss = m.loss_of(engine, m.make_batch(dp_rank))
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
