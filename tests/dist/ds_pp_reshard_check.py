"""DeepSpeed loads a resharded pipeline checkpoint at the new sizes, equal to the truth, and trains.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node PP*DP tests/dist/ds_pp_reshard_check.py \
        --ckpt OUT --fixture NAME --pp PP --partition-method uniform --result R.json

Every rank builds fixtures/generate_ds_pp.py's PipelineModule with PP stages (the given
partition_method) from another seed, `deepspeed.initialize` with the fixture's config at dp =
world / PP, `engine.load_checkpoint`, then takes its stage's state through DeepSpeed's own API
(the generator's stage_truth: safe_get_full_fp32_param, safe_get_full_optimizer_state, the
optimizer's step, the module's weights and buffers) and compares it bit for bit with the source's
truth (fixtures/data/ds_pp/NAME.truth.pt), then runs one train_batch. Rank 0 writes the result.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures"))
from _checks import run_check  # noqa: E402  (tests/dist, next to this script)

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--partition-method", default="uniform")
    ap.add_argument("--result", required=True)
    return ap.parse_args(argv)


def run(args: argparse.Namespace, rank: int, world: int) -> dict:
    """Load, compare and train (every rank); every rank's outcome gathered, the result whole on rank 0."""
    import deepspeed
    import torch
    import torch.distributed as dist

    import generate_ds_pp as gen

    stage, dtype, _, _, variant = gen.FIXTURES[args.fixture]
    dp = world // args.pp
    if dtype == "fp16":
        import deepspeed_models

        deepspeed_models.allow_fp16_on_cpu()
    from deepspeed.runtime import utils as ds_utils

    if not getattr(ds_utils.set_random_seed, "takes_numpy_ints", False):
        seed = ds_utils.set_random_seed  # partition_balanced's numpy ints reach random.seed, which refuses them
        ds_utils.set_random_seed = lambda value: seed(int(value))
        ds_utils.set_random_seed.takes_numpy_ints = True
    model_seed = gen.MODEL_SEED
    gen.MODEL_SEED += 1000  # nothing may pass by accident: every value comes from the checkpoint
    try:
        module = gen.build_pipeline(args.pp, variant, args.partition_method)
    finally:
        gen.MODEL_SEED = model_seed
    engine, *_ = deepspeed.initialize(model=module, config=gen.ds_config(stage, dtype, dp),
                                      model_parameters=[p for p in module.parameters() if p.requires_grad])
    result: dict = {"rank": rank, "stage": engine.stage_id, "parts": [int(x) for x in module.parts], "mismatches": [],
                    "compared": 0}
    try:
        path, _ = engine.load_checkpoint(args.ckpt)
        result["loaded"] = path is not None
        truth = torch.load(ROOT / "fixtures" / "data" / "ds_pp" / f"{args.fixture}.truth.pt", weights_only=True)
        got = gen.stage_truth(engine)
        for key, value in got.items():
            kind = key.partition(".")[0]
            if kind in ("stage", "lr"):
                continue
            want = truth.get(key)
            if isinstance(value, torch.Tensor) and isinstance(want, torch.Tensor):
                same = value.dtype == want.dtype and value.shape == want.shape and torch.equal(value, want)
            else:
                same = value == want
            if not same:
                result["mismatches"].append(key)
            result["compared"] += 1
        result["lr_ok"] = all(math.isclose(float(g["lr"]), truth["lr.0.0"], rel_tol=0, abs_tol=0)
                              for g in engine.optimizer.param_groups)
        result["steps_ok"] = (engine.global_steps == truth["global_steps"]
                              and engine.global_samples == truth["global_samples"])
        loss = float(engine.train_batch(data_iter=gen.data_iter()))
        result["loss"] = loss
        result["trained_step"] = math.isfinite(loss) and engine.global_steps == truth["global_steps"] + 1
    except Exception as exc:  # reported, not raised: rank 0 writes every rank's outcome
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-1500:]
    parts: list = [None] * world
    dist.all_gather_object(parts, result)
    ok = all(p.get("loaded") and not p["mismatches"] and p.get("trained_step") and p.get("lr_ok")
             and p.get("steps_ok") and "error" not in p for p in parts)
    return {"ok": ok, "world_size": world, "pp": args.pp, "dp": dp, "compared": sum(p["compared"] for p in parts),
            "ranks": parts}


def check_case(argv: list[str], rank: int, world: int) -> dict:
    """One case of a launch of several (tests/dist/ds_engine_cases.py): this script's options."""
    return run(parse_args(argv), rank, world)


def main() -> None:
    run_check(run, parse_args, pg_timeout=180)


if __name__ == "__main__":
    main()
