"""A real DeepSpeed job using ckptkit.Checkpointer (launched by tests/test_checkpointer.py).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node W tests/dist/ds_checkpointer_job.py \
        --phase save|resume --dir DIR --ds-config CFG --result R.json

save: builds fixtures/deepspeed_models.py's model with the fixture's DeepSpeed config, trains
2 steps, `Checkpointer(DIR).save(2, engine, extra={...})` (native ZeRO layout), and rank 0
writes DIR/../truth.pt gathered through DeepSpeed's own APIs (generate_deepspeed.collect_truth).
resume (another world size): a fresh engine from another seed; `Checkpointer(DIR).restore(engine)`
must return 2, bring back the extra, and hold the truth bit for bit (fp32 masters, moments,
steps, frozen params, module weights, buffers, lr, counters), then train a step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import deepspeed_models as dm  # noqa: E402
from _checks import run_and_leave, start_watchdog  # noqa: E402
from ds_load_check import compare  # noqa: E402

from ckptkit import Checkpointer  # noqa: E402

EXTRA = {"epoch": 3, "note": "hello"}


def engine_for(cfg_path: str, seed: int):
    import deepspeed

    cfg = dm.with_world_size(json.loads(Path(cfg_path).read_text()), dist.get_world_size())
    if cfg.get("fp16", {}).get("enabled"):
        dm.allow_fp16_on_cpu()
    model = dm.make_model(seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=dm.param_groups(model), config=cfg)
    return engine, int(cfg["zero_optimization"]["stage"])


def main() -> None:
    import deepspeed

    import generate_deepspeed as gen

    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "resume"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--deadline", type=float, default=600)
    args = ap.parse_args()
    start_watchdog(args.deadline)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=180))
    rank = dist.get_rank()
    truth_file = Path(args.dir).parent / "truth.pt"
    def body() -> dict:
        if args.phase == "save":
            engine, stage = engine_for(args.ds_config, dm.MODEL_SEED)
            for _ in range(2):
                dm.train_step(engine)
            Checkpointer(args.dir, keep=2).save(2, engine, extra=EXTRA)
            truth = gen.collect_truth(engine, stage)
            for k, v in EXTRA.items():
                truth[f"client.{k}"] = v
            if rank == 0:
                torch.save(truth, truth_file)
            return {"ok": True, "world_size": dist.get_world_size()}
        engine, stage = engine_for(args.ds_config, dm.MODEL_SEED + 1)
        ckpt = Checkpointer(args.dir, keep=2)
        step = ckpt.restore(engine)
        got = gen.collect_truth(engine, stage)
        for k, v in (ckpt.extra or {}).items():
            got[f"client.{k}"] = v
        compared, mismatches = 0, []
        if rank == 0:
            compared, mismatches = compare(got, torch.load(truth_file, weights_only=True))
        before = int(engine.global_steps)
        loss = dm.train_step(engine)
        trained = math.isfinite(loss) and int(engine.global_steps) == before + 1
        leftovers = sorted(n for n in os.listdir(args.dir) if n.startswith("."))
        return {"ok": step == 2 and compared >= 50 and not mismatches and trained and not leftovers,
                "step": step, "compared": compared, "mismatches": mismatches, "trained_step": trained,
                "extra": ckpt.extra, "leftovers": leftovers, "world_size": dist.get_world_size()}

    run_and_leave(rank, args.result, body)

if __name__ == "__main__":
    main()
