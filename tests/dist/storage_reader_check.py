"""Multi-process check that torch's plain `dcp.load` + `set_state_dict`, reading through
`ckptkit.StorageReader`, fills FSDP2 + TP models on a 2 x 2 mesh from checkpoints that are no DCP.

    torchrun --nproc_per_node 4 tests/dist/storage_reader_check.py --zero3 DIR --zero3-truth TRUTH.pt \
        --tp DIR --tp-truth TRUTH.pt --hf DIR --result OUT.json

Every rank builds each model from ANOTHER seed (nothing passes by accident) on
init_device_mesh("cpu", (2, 2), ("dp_shard", "tp")), then `get_state_dict` (which creates AdamW's
state), `dcp.load(state, storage_reader=ckptkit.StorageReader(DIR))`, `set_state_dict`; the full
state gathered (full_state_dict=True) is compared bit for bit with the source's truth:

1. `--zero3`: a DeepSpeed ZeRO-3 checkpoint of fixtures/deepspeed_models.py's DSToyModel (truth:
   DeepSpeed's own fp32 masters, exp_avg, exp_avg_sq, frozen weights, buffers, global_steps and
   group lr), the MLP tensor-parallel (fc_in row-wise, fc_out column-wise), every module under
   fully_shard on "dp_shard"; AdamW with the fixture's two groups.
2. `--tp`: a DeepSpeed ZeRO-2 AutoTP checkpoint of the fixtures' LlamaForCausalLM (truth:
   DeepSpeed's), parallelised as torchtitan does (mesh_convert_check.build_llama).
3. `--hf`: a Hugging Face safetensors folder (save_pretrained, several shards) of the same Llama:
   the model only (such a folder holds no optimizer); truth: safetensors.torch.load_file.

Each model then trains one step. Last, a state dict asking for a key the checkpoint lacks:
`StorageReader.load` raises ckptkit's sentence naming it, the same on every rank. Rank 0 writes
{"ok", "zero3": {...}, "tp": {...}, "hf": {...}, "refusal": {...}}.
Exit 0 when the check ran to the end, 1 when it crashed, 124 when the --deadline watchdog fired.
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
import torch.nn.functional as F  # noqa: E402

from _checks import compare_one, run_and_leave, start_watchdog  # noqa: E402
from mesh_convert_check import build_llama, expected, full_state, llama_loss, train_one_step  # noqa: E402

import deepspeed_models as dm  # noqa: E402
import generate_convert as gc  # noqa: E402


def build_toy(mesh, seed: int):
    """DSToyModel with its MLP tensor-parallel on "tp" and every module sharded on "dp_shard"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = dm.make_model(seed)
    with torch.no_grad():  # buffers are constants: changed so that a skipped load shows
        model.positions.copy_(model.positions.flip(0))
        model.temperature.fill_(7.0)
    parallelize_module(model.block, mesh["tp"], {"fc_in": RowwiseParallel(input_layouts=Replicate()),
                                                 "fc_out": ColwiseParallel(output_layouts=Replicate())})
    gc.shard_fsdp2(model, mesh["dp_shard"])
    return model, gc.make_optimizer(model)


def toy_loss(model):
    tokens, targets = dm.make_batch(dm.DATA_SEED)
    logits = model(tokens)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load_through_reader(model, optim, src: str) -> None:
    """What a training loop writes: torch's own calls, ckptkit's reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckptkit

    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=ckptkit.StorageReader(src))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)


def check_zero3(mesh, src: str, truth_path: str, rank: int) -> dict:
    model, optim = build_toy(mesh, seed=dm.MODEL_SEED + 1)
    load_through_reader(model, optim, src)
    got = full_state(model, optim)
    out: dict = {}
    if rank == 0:
        truth = torch.load(truth_path, weights_only=True)
        want = expected(truth, got)
        want["model.lm_head.weight"] = truth["fp32.embed.weight"]  # tied to the embedding
        for name in ("frozen.weight", "frozen.bias"):  # DeepSpeed keeps frozen weights in bf16; the
            want[f"model.{name}"] = truth[f"frozen.{name}"].float()  # fp32 model holds them cast (exact)
        for g in (0, 1):
            want[f"optim.param_groups.{g}.lr"] = truth[f"lr.{g}"]
        want["optim.param_groups.0.weight_decay"], want["optim.param_groups.1.weight_decay"] = dm.WEIGHT_DECAY, 0.0
        mismatches = [m for k in sorted(want) if (m := compare_one(k, got.get(k), want[k])) is not None]
        out = {"compared": len(want), "mismatches": mismatches[:20], "n_mismatches": len(mismatches)}
    out.update(train_one_step(model, optim, toy_loss))
    return out


def check_tp(mesh, src: str, truth_path: str, rank: int) -> dict:
    model, optim = build_llama(mesh, seed=4321)
    load_through_reader(model, optim, src)
    got = full_state(model, optim)
    out: dict = {}
    if rank == 0:
        truth = torch.load(truth_path, weights_only=True)
        want = expected(truth, got)
        mismatches = [m for k in sorted(want) if (m := compare_one(k, got.get(k), want[k])) is not None]
        out = {"compared": len(want), "mismatches": mismatches[:20], "n_mismatches": len(mismatches)}
    out.update(train_one_step(model, optim, llama_loss))
    return out


def check_hf(mesh, src: str, rank: int) -> dict:
    """The model alone: dcp.load of {"model": ...} and set_model_state_dict."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import ckptkit

    model, optim = build_llama(mesh, seed=8765)
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, storage_reader=ckptkit.StorageReader(src))
    set_model_state_dict(model, msd)
    got = full_state(model, optim)
    out: dict = {}
    if rank == 0:
        want: dict = {}
        for shard in sorted(Path(src).glob("*.safetensors")):
            want.update({f"model.{k}": v for k, v in load_file(shard).items()})
        got_model = {k: v for k, v in got.items() if k.startswith("model.")}
        mismatches = [m for k in sorted(set(want) | set(got_model))
                      if (m := compare_one(k, got_model.get(k), want.get(k))) is not None]
        out = {"compared": len(want), "mismatches": mismatches[:20], "n_mismatches": len(mismatches)}
    out.update(train_one_step(model, optim, llama_loss))
    return out


def check_refusal(src: str) -> dict:
    """A key the checkpoint lacks: torch's CheckpointException on every rank, which
    StorageReader.load raises as ckptkit's one sentence naming the key, the same on every rank."""
    import ckptkit
    from ckptkit.errors import FormatError

    reader = ckptkit.StorageReader(src)
    try:
        reader.load({"model": {"not_there": torch.zeros(2)}})
        mine = "no error"
    except FormatError as exc:
        mine = str(exc)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"messages": sorted(set(every)), "ok": len(set(every)) == 1 and "has no model.not_there" in mine
            and "\n" not in mine}


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--zero3", "--zero3-truth", "--tp", "--tp-truth", "--hf", "--result"):
        ap.add_argument(name, required=True)
    ap.add_argument("--deadline", type=float, default=300)
    args = ap.parse_args()
    start_watchdog(args.deadline)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()

    def body() -> dict:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        out: dict = {"world_size": dist.get_world_size(), "torch": torch.__version__}
        out["zero3"] = check_zero3(mesh, args.zero3, args.zero3_truth, rank)
        out["tp"] = check_tp(mesh, args.tp, args.tp_truth, rank)
        out["hf"] = check_hf(mesh, args.hf, rank)
        out["refusal"] = check_refusal(args.zero3)
        out["ok"] = rank != 0 or (out["refusal"]["ok"] and all(not out[k]["n_mismatches"] and out[k]["trained_step"]
                                                              for k in ("zero3", "tp", "hf")))
        return out

    run_and_leave(rank, args.result, body)


if __name__ == "__main__":
    main()
