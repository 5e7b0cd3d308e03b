"""An HF model under FSDP2 loads a DCP folder with torch's own APIs, every value equal to transformers'.

    torchrun --nproc_per_node M tests/dist/hf_fsdp2_load_job.py --model HF_FOLDER --ckpt DCP --result OUT.json
        [--model HF_FOLDER2 --ckpt DCP2 --result OUT2.json ...]

Every rank builds the model of HF_FOLDER's config.json from scratch (transformers' AutoModelForCausalLM
.from_config, seeded apart from the saved weights), shards each decoder layer and the root with
FSDP2's fully_shard, then does what a training job does: `get_model_state_dict`, `dcp.load` of the
`{"model": ...}` dict, `set_model_state_dict`. The full state dict gathered afterwards is compared,
key for key (tied names included, as `model.state_dict()` lists them), with what
`from_pretrained(HF_FOLDER)` builds: transformers' own reading of the folder is the truth.

Rank 0 writes {"ok", "compared", "mismatches", "keys"}; exit 0 when the check ran. Several
--model/--ckpt/--result triples are checked one after the other in the same job (one job start,
the costly part, for several folders).
"""
from __future__ import annotations

import argparse
import datetime
import sys
import traceback

import torch
import torch.distributed as dist

from _checks import compare_one, leave, start_watchdog, write_result  # noqa: E402  (tests/dist)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, action="append", help="the HF folder (config.json + safetensors)")
    ap.add_argument("--ckpt", required=True, action="append", help="the DCP folder to load")
    ap.add_argument("--result", required=True, action="append")
    ap.add_argument("--deadline", type=float, default=240.0)
    return ap.parse_args()


def _sharded_model(folder: str):
    import transformers
    from torch.distributed.fsdp import fully_shard

    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(1234)  # not the saved weights: nothing passes by accident
    model = transformers.AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        if type(module).__name__.endswith(("DecoderLayer", "Block")):
            fully_shard(module)
    fully_shard(model)
    return model


def main() -> int:
    args = _parse()
    start_watchdog(args.deadline)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    if not len(args.model) == len(args.ckpt) == len(args.result):
        raise SystemExit("give --model, --ckpt and --result the same number of times")
    code = 0
    for model, ckpt, result in zip(args.model, args.ckpt, args.result):
        code = max(code, _check(model, ckpt, result, dist.get_rank()))
    return code


def _check(folder: str, ckpt: str, result: str, rank: int) -> int:
    try:
        import transformers
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             set_model_state_dict)

        model = _sharded_model(folder)
        msd = get_model_state_dict(model)
        dcp.load({"model": msd}, checkpoint_id=ckpt)
        set_model_state_dict(model, msd)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            truth = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
            problems = [p for k in sorted(set(truth) | set(full))
                        if (p := compare_one(k, full.get(k), truth.get(k))) is not None]
            write_result(result, {"ok": not problems and len(truth) == len(full), "compared": len(truth),
                                  "mismatches": problems[:20], "keys": sorted(full)})
        return 0
    except Exception:
        traceback.print_exc()
        if rank == 0:
            write_result(result, {"ok": False, "error": traceback.format_exc()[-2000:]})
        return 1


if __name__ == "__main__":
    code = main()
    leave(code)
    sys.exit(code)
