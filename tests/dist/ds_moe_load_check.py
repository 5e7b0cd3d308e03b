"""Multi-process check that DeepSpeed loads a mixture-of-experts checkpoint at new parallel sizes.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W tests/dist/ds_moe_load_check.py \
        --ckpt DIR --fixture NAME --ep E --result OUT.json
    ... --batch BATCH.json --result OUT.json     (BATCH: a list of {ckpt, fixture, ep})

NAME is a fixture of fixtures/generate_ds_moe.py (its truth is fixtures/data/ds_moe/NAME.truth.pt,
keyed by global expert id). Every rank builds the fixture's model (generate_ds_moe.build_model) with
`ep_size` E, its weights then overwritten from another seed (nothing passes by accident), the
fixture's DeepSpeed config with train_batch_size re-derived for W, the same MoE param groups, then:

1. ``engine.load_checkpoint(DIR)`` (its ``latest``), with optimizer and scheduler states;
2. on every rank, the generator's ``collect_truth`` (``safe_get_full_fp32_param`` /
   ``safe_get_full_optimizer_state`` over the dense and the expert-data-parallel groups, local
   experts renamed to global ids), gathered to rank 0 and compared bit for bit (dtype, shape,
   torch.equal; plain values with ==) with the truth: ``fp32.*``, ``exp_avg.*``, ``exp_avg_sq.*``,
   ``step.*``, ``module.*``, ``lr.*``, ``global_steps``, ``client.*``; every expert of every layer
   must have been seen, each on the rank DeepSpeed's groups say;
3. one more training step on every rank (finite loss, global_steps advances).

Rank 0 writes {"ok", "world_size", "ep", "compared", "mismatches", "trained_step", "error"} (with
--batch: {"results": [...]}). Never hangs: process-group timeout, watchdog, os._exit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _checks import compare_one, leave, start_watchdog, write_result  # noqa: E402

import generate_ds_moe as gen  # noqa: E402

DATA = REPO / "fixtures" / "data" / "ds_moe"
COMPARED = ("fp32.", "exp_avg.", "exp_avg_sq.", "step.", "module.", "lr.", "client.")
REQUIRED = ("fp32.", "exp_avg.", "exp_avg_sq.", "step.", "module.", "lr.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt")
    ap.add_argument("--fixture")
    ap.add_argument("--ep", type=int)
    ap.add_argument("--batch", default=None)
    ap.add_argument("--result", required=True)
    ap.add_argument("--pg-timeout", type=float, default=120.0)
    ap.add_argument("--deadline", type=float, default=600.0)
    return ap.parse_args(argv)


def compare(got: dict, truth: dict) -> tuple[int, list[str]]:
    want = {k for k in truth if k.startswith(COMPARED) or k == "global_steps"}
    have = {k for k in got if k.startswith(COMPARED) or k == "global_steps"}
    mismatches = [f"{k}: missing after load" for k in sorted(want - have)]
    mismatches += [f"{k}: not in truth" for k in sorted(have - want)]
    compared = 0
    for k in sorted(want & have):
        compared += 1
        problem = compare_one(k, got[k], truth[k])
        if problem:
            mismatches.append(problem)
    mismatches += [f"truth has no {p}* entries" for p in REQUIRED if not any(k.startswith(p) for k in want)]
    return compared, mismatches


def _scramble(model: torch.nn.Module, seed: int) -> None:
    gen_ = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen_))


def run(args: argparse.Namespace, rank: int, world: int) -> dict:
    import deepspeed
    from deepspeed.utils import groups

    t0 = time.time()
    info = json.loads((DATA / args.fixture / "fixture.json").read_text())
    cfg = json.loads((DATA / args.fixture / "ds_config.json").read_text())
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * world
    model = gen.build_model(info["k"], 0, ep_size=args.ep, second_moe=info.get("second_moe_experts"))
    _scramble(model, 4242 + rank)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=gen.param_groups(model), config=cfg)
    name = model.moe.expert_group_name
    ep_rank = groups._get_expert_parallel_rank(name)
    if (ep_rank, groups._get_expert_data_parallel_rank(name)) != (rank % args.ep, rank // args.ep):
        raise RuntimeError(f"rank {rank}: DeepSpeed made ep rank {ep_rank}, not the E + D order the writer uses")
    tag = (Path(args.ckpt) / "latest").read_text().strip()
    load_path, client_state = engine.load_checkpoint(args.ckpt, tag=tag, load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"engine.load_checkpoint({args.ckpt!r}) loaded nothing")
    mine = gen.collect_truth(engine, ep_rank)
    views: list = [None] * world
    dist.all_gather_object(views, mine)
    compared, mismatches = 0, []
    if rank == 0:
        truth = torch.load(DATA / f"{args.fixture}.truth.pt", map_location="cpu", weights_only=True)
        got: dict = {}
        for r, view in enumerate(views):
            for k, v in view.items():
                if k in got and compare_one(k, v, got[k]):
                    mismatches.append(f"{k}: rank {r} disagrees with an earlier rank")
                got.setdefault(k, v)
        for g, group in enumerate(engine.optimizer.param_groups):
            got[f"lr.{g}"] = float(group["lr"])
            if group.get("moe") and group.get("name") != f"ep_size_{args.ep}":
                mismatches.append(f"param group {g} is named {group.get('name')!r} after load")
        got["global_steps"] = int(engine.global_steps)
        for k in truth:
            if k.startswith("client.") and client_state is not None and k[len("client."):] in client_state:
                got[k] = client_state[k[len("client."):]]
        c, m = compare(got, truth)
        compared, mismatches = c, mismatches + m
    steps_before = int(engine.global_steps)
    g = torch.Generator().manual_seed(gen.DATA_SEED + 1000 + rank)
    tokens = torch.randint(0, gen.VOCAB, (gen.MICRO_BATCH, gen.SEQ), generator=g)
    target = torch.randint(0, gen.VOCAB, (gen.MICRO_BATCH, gen.SEQ), generator=g)
    logits, l_aux = engine(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, gen.VOCAB), target.reshape(-1))
    loss = loss + 0.01 * l_aux.float()
    engine.backward(loss)
    engine.step()
    ok = math.isfinite(float(loss.detach())) and int(engine.global_steps) == steps_before + 1
    flags = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    trained = bool(flags[0].item() == world)
    return {"ok": bool(compared > 0 and not mismatches and trained), "world_size": world, "ep": args.ep,
            "compared": compared, "mismatches": mismatches[:50], "trained_step": trained, "error": None,
            "loss_after_load": float(loss.detach()), "seconds": round(time.time() - t0, 2)}


def _failure(rank: int, world: int, exc: BaseException) -> dict:
    out = {"ok": False, "world_size": world, "compared": 0, "mismatches": [], "trained_step": False,
           "error": f"rank {rank}: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    print(out["error"], file=sys.stderr, flush=True)
    return out


def check_case(argv: list[str], rank: int, world: int) -> dict:
    """One case of a launch of several (tests/dist/ds_engine_cases.py): this script's options."""
    args = parse_args(argv)
    return {**run(args, rank, world), "fixture": args.fixture, "ckpt": args.ckpt}


def main() -> None:
    args = parse_args()
    start_watchdog(args.deadline)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    items = json.loads(Path(args.batch).read_text()) if args.batch else \
        [{"ckpt": args.ckpt, "fixture": args.fixture, "ep": args.ep}]
    results, code = [], 0
    for item in items:
        one = argparse.Namespace(**{**vars(args), **item})
        try:
            res = run(one, rank, world)
        except BaseException as e:  # report this one, go on with the next
            res, code = _failure(rank, world, e), 1
        res.update({"fixture": item["fixture"], "ckpt": item["ckpt"], "ep": item["ep"]})
        results.append(res)
    if rank == 0:
        write_result(args.result, {"results": results, "world_size": world})
        for res in results:
            print(json.dumps({k: res.get(k) for k in ("fixture", "ep", "ok", "compared", "trained_step", "error")}),
                  flush=True)
            for m in res["mismatches"][:10]:
                print("MISMATCH", m, flush=True)
    leave(code)


if __name__ == "__main__":
    main()
