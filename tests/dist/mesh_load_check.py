"""Multi-process check that a DCP folder written for a device mesh loads into the real model on
that mesh (FSDP2 + TP / HSDP, fixtures/generate_mesh.py's recipe) with torch's own APIs.

    torchrun --nproc_per_node N tests/dist/mesh_load_check.py --ckpt DIR --mesh dp_shard:1,tp:4 \
        --truth TRUTH.pt --result OUT.json

Every rank builds the model on the mesh from a DIFFERENT seed (so nothing passes by accident),
initialises AdamW's state (get_state_dict), then `dcp.load({"model", "optim"})` and
`set_state_dict`; gathers the full state (StateDictOptions(full_state_dict=True)) and compares
every flat key of the truth bit for bit; then trains one step. Rank 0 writes {"ok", "compared",
"mismatches", "trained_step"}. Exit 0 when the check ran to the end, 1 when it crashed, 124 when the
--deadline watchdog fired.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _checks import compare_one, run_and_leave, start_watchdog  # noqa: E402

import generate_mesh as gm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--truth", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--deadline", type=float, default=240)
    args = ap.parse_args()
    start_watchdog(args.deadline)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()

    def body() -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optim = gm.build(args.mesh, seed=gm.MODEL_SEED + 1)
        msd, osd = get_state_dict(model, optim)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=args.ckpt)
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        got = gm.full_state(model, optim)
        truth = torch.load(args.truth, weights_only=True)
        mismatches = [m for k in sorted(set(truth) | set(got))
                      if (m := compare_one(k, got.get(k), truth.get(k))) is not None]
        losses = gm.train(model, optim, 1)
        return {"ok": not mismatches, "world_size": dist.get_world_size(), "compared": len(truth),
                "mismatches": mismatches[:20], "trained_step": bool(losses) and all(l == l for l in losses),
                "loss": losses}

    run_and_leave(rank, args.result, body)


if __name__ == "__main__":
    main()
