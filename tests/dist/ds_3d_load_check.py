"""DeepSpeed loads a resharded 3-D checkpoint at the new sizes, equal to the truth, and trains.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node TP*PP*DP tests/dist/ds_3d_load_check.py \
        --ckpt OUT --fixture NAME --tp TP --pp PP --result R.json

Every rank builds fixtures/generate_ds_3d.py's PipelineModule on PipeModelDataParallelTopology
(PP, TP, world / (PP * TP)) with partition_method "uniform" from other seeds, `deepspeed.initialize`
with the fixture's config, `engine.load_checkpoint`, then takes its slices through DeepSpeed's own
API (the generator's rank_truth: safe_get_full_fp32_param, safe_get_full_optimizer_state, the
optimizer's step, the module's weights) and compares each bit for bit with its tp rank's slice of
the source's truth (fixtures/data/ds_3d/NAME.truth.pt, sliced by ds_tp_models.slice_of along the
layer's split), then runs one train_batch. Rank 0 writes the result.
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
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--truth", default=None, help="the truth file (default fixtures/data/ds_3d/NAME.truth.pt)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace, rank: int, world: int) -> dict:
    """Load, compare and train (every rank); every rank's outcome gathered, the result whole on rank 0."""
    import deepspeed
    import torch
    import torch.distributed as dist

    import ds_tp_models
    import generate_ds_3d as gen

    zstage, dtype, _, _, _ = gen.FIXTURES[args.fixture]
    tp, pp = args.tp, args.pp
    dp = world // (tp * pp)
    init_seed = gen.INIT_SEED
    gen.INIT_SEED += 5000  # nothing may pass by accident: every value comes from the checkpoint
    try:
        module = gen.build_pipeline(pp, tp, dp, "uniform")
    finally:
        gen.INIT_SEED = init_seed
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                      config=gen.ds_config(zstage, dtype, dp))
    coord = module._topo.get_coord(rank)
    result: dict = {"rank": rank, "coord": [coord.pipe, coord.data, coord.model], "mismatches": [], "compared": 0}
    try:
        engine.load_checkpoint(args.ckpt, tag="global_step2")
        truth_path = args.truth or ROOT / "fixtures" / "data" / "ds_3d" / f"{args.fixture}.truth.pt"
        truth = torch.load(truth_path, weights_only=True)
        mine = gen.rank_truth(engine)
        result["names"] = sorted(mine)
        for name, values in mine.items():
            split = truth[f"split.{name}"]
            for key, got in values.items():
                full = truth[f"{key}.{name}"]
                want = full if key == "step" else ds_tp_models.slice_of(full, split, coord.model, tp)
                same = (got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)) \
                    if isinstance(got, torch.Tensor) else got == want
                result["compared"] += 1
                if not same:
                    result["mismatches"].append(f"{key}.{name}")
        result["global_steps"] = int(engine.global_steps)
        it = gen.data_iter(coord.data)
        loss = engine.train_batch(data_iter=it)
        result["loss"] = float(loss)
        result["loss_finite"] = math.isfinite(float(loss))
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which writes it
        result["error"] = f"{type(exc).__name__}: {exc}"
    parts: list = [None] * world
    dist.all_gather_object(parts, result)
    return {"ranks": parts, "tp": tp, "pp": pp, "dp": dp}


def check_case(argv: list[str], rank: int, world: int) -> dict:
    """One case of a launch of several (tests/dist/ds_engine_cases.py): this script's options."""
    return run(parse_args(argv), rank, world)


def main() -> None:
    run_check(run, parse_args, pg_timeout=180)


if __name__ == "__main__":
    main()
