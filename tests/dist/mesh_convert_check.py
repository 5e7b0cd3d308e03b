"""Multi-process check that DeepSpeed checkpoints converted to DCP load into the real torch models,
on a 2-D mesh (FSDP2 + TP) and on a 1-D one (FSDP2), with torch's own APIs.

    torchrun --nproc_per_node 4 tests/dist/mesh_convert_check.py \
        --tp-ckpt DIR --tp-truth TRUTH.pt --pp-ckpt DIR --pp-truth TRUTH.pt --resave DIR --result OUT.json

1. `--tp-ckpt`: `ckptkit convert` of the AutoTP Llama fixture (fixtures/data/ds_tp/autotp_*) with
   `--world-size mesh=dp_shard:2,tp:2`. Every rank builds `LlamaForCausalLM` from the fixture's
   config (fixtures/generate_ds_tp.py LLAMA) from ANOTHER seed, on init_device_mesh("cpu", (2, 2),
   ("dp_shard", "tp")) as torchtitan parallelizes it: parallelize_module on "tp" with ColwiseParallel
   for q/k/v/gate/up and lm_head (output replicated), RowwiseParallel for o/down; embeddings and
   norms as the source records them (AutoTP keeps them replicated: left alone); fully_shard of each
   decoder layer and of the model on "dp_shard"; AdamW.
2. `--pp-ckpt`: `ckptkit convert` of a DeepSpeed pipeline fixture (fixtures/data/ds_pp) with
   `--world-size 4`, loaded into a plain torch module with PipelineModule's parameter names
   (`tied_modules.embed.weight`, `1.fc_in.weight`, ...: the layers of fixtures/generate_ds_pp.py's
   build_pipeline, a frozen weight and float buffers included) under fully_shard on a 1-D mesh.

For each: get_state_dict (which creates AdamW's state), dcp.load({"model", "optim"}),
set_state_dict; the full state gathered (full_state_dict=True) is compared with DeepSpeed's truth
bit for bit: every fp32 master, exp_avg, exp_avg_sq, frozen weight and buffer, and each step equals
DeepSpeed's global_steps. Then the job saves the loaded state itself with dcp.save into
`--resave/tp` and `--resave/pp` (the test compares them item by item with ckptkit's output), and
trains one step. Rank 0 writes {"ok", "tp": {...}, "pp": {...}}. Exit 0 when the check ran to the
end, 1 when it crashed, 124 when the --deadline watchdog fired.
"""
from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _checks import compare_one, run_and_leave, start_watchdog  # noqa: E402

import generate_ds_pp as gp  # noqa: E402
import generate_ds_tp as gt  # noqa: E402

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)  # overwritten by the load
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
LLAMA_BATCH_SEED = 1234  # the same batch on every rank


def build_llama(mesh, seed: int):
    """LlamaForCausalLM on ("dp_shard", "tp"), torchtitan's plan for the layers AutoTP splits."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**gt.LLAMA))
    tp, dp = mesh["tp"], mesh["dp_shard"]
    parallelize_module(model, tp, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.model.layers:
        plan = {**{n: ColwiseParallel() for n in COLWISE}, **{n: RowwiseParallel() for n in ROWWISE}}
        parallelize_module(layer, tp, plan)
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(gp.VOCAB, gp.DIM) * 0.1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(gp.DIM, gp.HIDDEN)
        self.fc_out = nn.Linear(gp.HIDDEN, gp.DIM)
        self.register_buffer("scale", torch.tensor(0.25))  # not the fixture's 0.5: the load must set it

    def forward(self, x):
        return x + self.scale * self.fc_out(torch.tanh(self.fc_in(x)))


class FrozenBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(gp.DIM, gp.DIM)
        self.frozen = nn.Linear(gp.DIM, gp.DIM, bias=False)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x):
        return x + self.proj(x) + 0.1 * torch.tanh(self.frozen(x))


class PlainPipe(nn.Module):
    """build_pipeline's layers without PipelineModule, under the names its checkpoint gives them:
    the tied embedding (also the head) in `tied_modules.embed`, layers 1-4 by their index."""

    def __init__(self) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict({"embed": Embed()})
        for i, layer in enumerate([Block(), FrozenBlock(), Block(), nn.LayerNorm(gp.DIM)], start=1):
            self.add_module(str(i), layer)

    def forward(self, tokens):
        w = self.tied_modules["embed"].weight
        h = F.embedding(tokens, w)
        for i in range(1, 5):
            h = getattr(self, str(i))(h)
        return h @ w.t()


def build_pipe(mesh, seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = PlainPipe()
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)


def load(model, optim, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)  # creates AdamW's state for DCP to load into
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)


def resave(model, optim, where: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)


def full_state(model, optim) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return dict(flatten_state_dict({"model": m, "optim": o})[0])


def expected(truth: dict, got: dict) -> dict:
    """DeepSpeed's truth under torch's keys: fp32.<p> -> model.<p>, exp_avg(_sq).<p> -> optim.state.<p>.*,
    frozen.<p> and buffer.<b> -> model.*, each parameter's step -> DeepSpeed's global_steps."""
    want = {}
    steps = float(truth["global_steps"])
    for key, value in truth.items():
        kind, _, name = key.partition(".")
        if kind in ("fp32", "frozen", "buffer"):
            want[f"model.{name}"] = value
        elif kind in ("exp_avg", "exp_avg_sq"):
            want[f"optim.state.{name}.{kind}"] = value
        if kind == "fp32":
            want[f"optim.state.{name}.step"] = torch.tensor(steps)
    # every state tensor and model tensor the job has must be in the truth, and the reverse
    for key in got:
        if key.startswith(("model.", "optim.state.")) and key not in want:
            want[key] = None
    return want


def check(model, optim, truth_path: str, rank: int) -> dict:
    got = full_state(model, optim)
    if rank != 0:
        return {}
    truth = torch.load(truth_path, weights_only=True)
    want = expected(truth, got)
    mismatches = [m for k in sorted(want) if (m := compare_one(k, got.get(k), want[k])) is not None]
    return {"compared": len(want), "mismatches": mismatches[:20], "n_mismatches": len(mismatches)}


def train_one_step(model, optim, batch) -> dict:
    before = [float(s["step"]) for s in optim.state.values()]
    optim.zero_grad(set_to_none=True)
    loss = batch(model)
    loss.backward()
    optim.step()
    after = [float(s["step"]) for s in optim.state.values()]
    ok = math.isfinite(float(loss)) and after == [b + 1 for b in before] and len(after) > 0
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag)
    return {"loss": float(loss), "trained_step": int(flag) == dist.get_world_size()}


def llama_loss(model):
    g = torch.Generator().manual_seed(LLAMA_BATCH_SEED)
    tokens = torch.randint(0, gt.LLAMA["vocab_size"], (2, 8), generator=g)
    return model(input_ids=tokens, labels=tokens).loss


def pipe_loss(model):
    g = torch.Generator().manual_seed(gp.DATA_SEED)
    tokens = torch.randint(0, gp.VOCAB, (gp.MICRO_BATCH, gp.SEQ), generator=g)
    labels = torch.randint(0, gp.VOCAB, (gp.MICRO_BATCH, gp.SEQ), generator=g)
    return F.cross_entropy(model(tokens).reshape(-1, gp.VOCAB), labels.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--tp-ckpt", "--tp-truth", "--pp-ckpt", "--pp-truth", "--resave", "--result"):
        ap.add_argument(name, required=True)
    ap.add_argument("--deadline", type=float, default=240)
    args = ap.parse_args()
    start_watchdog(args.deadline)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()

    def body() -> dict:
        from torch.distributed.device_mesh import init_device_mesh

        out: dict = {"world_size": dist.get_world_size(), "torch": torch.__version__}
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model, optim = build_llama(mesh, seed=4321)
        load(model, optim, args.tp_ckpt)
        out["tp"] = check(model, optim, args.tp_truth, rank)
        resave(model, optim, str(Path(args.resave) / "tp"))
        out["tp"].update(train_one_step(model, optim, llama_loss))

        mesh1 = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        model, optim = build_pipe(mesh1, seed=gp.MODEL_SEED + 1)
        load(model, optim, args.pp_ckpt)
        out["pp"] = check(model, optim, args.pp_truth, rank)
        resave(model, optim, str(Path(args.resave) / "pp"))
        out["pp"].update(train_one_step(model, optim, pipe_loss))
        out["ok"] = rank != 0 or all(not out[k]["n_mismatches"] and out[k]["trained_step"] for k in ("tp", "pp"))
        return out

    run_and_leave(rank, args.result, body)


if __name__ == "__main__":
    main()
