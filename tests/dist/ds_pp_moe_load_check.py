"""Multi-process check that DeepSpeed loads a MoE PipelineModule checkpoint at a new pp, ep and dp.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node P*W \
        tests/dist/ds_pp_moe_load_check.py --ckpt DIR --fixture NAME [--pp P] --ep E --result OUT.json \
        [--partition-method M] [--save DIR2]

NAME is a fixture of fixtures/generate_ds_pp_moe.py (truth: fixtures/data/ds_pp_moe/NAME.truth.pt,
PipelineModule names with global expert ids). Every rank builds the fixture's PipelineModule (its
P stages, the fixture's or --pp) with MoE layers of ep_size E, its weights overwritten from another seed, the fixture's
config with the batch for W = world / P, then ``engine.load_checkpoint(DIR)`` with optimizer
states; every parameter of the rank's stage (local experts under their global ids) compared bit
for bit with the truth through ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` and
the module weight; with --save, ``engine.save_checkpoint(DIR2)`` (DeepSpeed's own files at these
sizes, for the caller to compare with ours); one ``train_batch`` (finite loss, global_steps advances).
Rank 0 writes {"ok", "world_size", "ep", "compared", "mismatches", "trained_step", "error"}.
tests/dist/ds_engine_cases.py runs it as one case of a launch of several (check_case).
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
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--pp", type=int, default=None, help="pipeline stages (default: the fixture's)")
    ap.add_argument("--partition-method", default="uniform", help="the PipelineModule's (the fixtures': uniform)")
    ap.add_argument("--save", default=None, help="after the comparison, DeepSpeed saves what it loaded here")
    return ap.parse_args(argv)


def run(args: argparse.Namespace, rank: int, world: int) -> dict:
    """Load, compare, save if asked and train one step (every rank); the result, complete on rank 0.
    Raises what fails (DeepSpeed refusing the checkpoint, a rank's error)."""

    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    import generate_ds_pp_moe as gen

    stage, dtype, pp, _, _, blocks = gen.FIXTURES[args.fixture]
    pp = args.pp or pp
    dp, ep = world // pp, args.ep
    result: dict = {"ok": False, "world_size": world, "pp": pp, "ep": ep, "compared": 0, "mismatches": [],
                    "trained_step": False, "error": None}
    mismatches: list[str] = []
    compared = 0
    truth = torch.load(REPO / "fixtures" / "data" / "ds_pp_moe" / f"{args.fixture}.truth.pt", weights_only=False)
    model = gen.build_pipeline(pp, ep, blocks, args.partition_method)
    g = torch.Generator().manual_seed(999)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    pgroups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "all"}])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=pgroups, config=gen.ds_config(stage, dtype, dp))
    load_with_states(engine, args.ckpt)
    moes = {n: m for n, m in engine.module.named_modules() if isinstance(m, MoE)}
    ep_rank = groups._get_expert_parallel_rank(next(iter(moes.values())).expert_group_name)

    def check(what: str, got, want) -> None:
        nonlocal compared
        compared += 1
        got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape \
                or not torch.equal(got, want):
            mismatches.append(f"rank {rank} (ep {ep_rank}): {what}")

    for pname, p in engine.module.named_parameters():
        gname = pname
        if is_moe_param(p):
            head, tail = pname.split(gen.MARK, 1)
            idx, rest = tail.split(".", 1)
            gname = f"{head}{gen.MARK}{int(idx) + ep_rank * moes[head].num_local_experts}.{rest}"
        check(f"fp32.{gname}", safe_get_full_fp32_param(p), truth[f"fp32.{gname}"])
        for key in ("exp_avg", "exp_avg_sq"):
            check(f"{key}.{gname}", safe_get_full_optimizer_state(p, key), truth[f"{key}.{gname}"])
        check(f"module.{gname}", p.data.clone(), truth[f"module.{gname}"])
    if int(engine.global_steps) != int(truth["global_steps"]):
        mismatches.append(f"rank {rank}: global_steps {engine.global_steps} != {truth['global_steps']}")
    if args.save:  # DeepSpeed's own files at these sizes, to compare ours with object for object
        engine.save_checkpoint(args.save, tag=gen.TAG)
    before = int(engine.global_steps)
    loss = engine.train_batch(data_iter=gen.data_iter())
    trained = math.isfinite(float(loss)) and int(engine.global_steps) == before + 1
    return join_verdicts(result, world, compared, mismatches, trained)


def check_case(argv: list[str], rank: int, world: int) -> dict:
    """One case of a launch of several (tests/dist/ds_engine_cases.py): this script's options."""
    return run(parse_args(argv), rank, world)


def main() -> None:
    run_check(run, parse_args)


if __name__ == "__main__":
    main()
