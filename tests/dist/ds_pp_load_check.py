"""A consolidated pipeline checkpoint loads into DeepSpeed's PipelineModule and trains.

    DS_ACCELERATOR=cpu python tests/dist/ds_pp_load_check.py --weights MODEL.safetensors \
        --truth TRUTH.pt --result OUT.json

One process (gloo, world 1): builds fixtures/generate_ds_pp.py's PipelineModule on ONE stage
(every layer on it) from a different seed, loads the consolidated weights with
`load_state_dict(strict=True)` (so the names must be exactly those `PipelineModule.state_dict()`
gives), compares every parameter and buffer bit for bit with the truth taken from DeepSpeed at
save time, then wraps it with deepspeed.initialize and trains one `train_batch`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--truth", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    import deepspeed
    import torch
    from safetensors.torch import load_file

    import generate_ds_pp as gen

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    gen.MODEL_SEED += 1000  # nothing may pass by accident: every value comes from the file
    module = gen.build_pipeline(num_stages=1)
    weights = load_file(args.weights)
    missing, unexpected = module.load_state_dict(weights, strict=True)
    truth = torch.load(args.truth, weights_only=True)
    compared, mismatches = 0, []
    state = module.state_dict()
    for key, value in truth.items():
        kind, _, name = key.partition(".")
        if kind in ("fp32", "frozen", "buffer"):
            want = value.float() if value.is_floating_point() else value
            got = state[name]
            if not (got.dtype == want.dtype and torch.equal(got, want)):
                mismatches.append(name)
            compared += 1
    engine, *_ = deepspeed.initialize(model=module, config=gen.ds_config(1, "fp32", 1),
                                      model_parameters=[p for p in module.parameters() if p.requires_grad])
    loss = float(engine.train_batch(data_iter=gen.data_iter()))
    Path(args.result).write_text(json.dumps({"compared": compared, "mismatches": mismatches,
                                             "keys": sorted(state), "loss": loss,
                                             "missing": list(missing), "unexpected": list(unexpected)}))


if __name__ == "__main__":
    main()
