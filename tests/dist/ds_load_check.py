"""Multi-process check that a DeepSpeed ZeRO checkpoint loads with DeepSpeed's own APIs.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node M tests/dist/ds_load_check.py \
        --ckpt DIR --fixture NAME --truth TRUTH.pt --result OUT.json [--tag TAG]

(``deepspeed --num_gpus M --no_local_rank tests/dist/ds_load_check.py ...`` works too;
DS_ACCELERATOR defaults to cpu here.)

DIR is a DeepSpeed save dir (holding ``<tag>/`` and usually ``latest``), NAME a
fixture of ``fixtures/generate_deepspeed.py`` (e.g. ``z2_bf16_w2``), TRUTH its
``<name>.truth.pt``.  M may differ from the fixture's world size: a checkpoint
rewritten for M ranks must load at M ranks; DeepSpeed's own checkpoint loads
only at the world size it was saved at.

Every rank builds ``fixtures/deepspeed_models.py``'s model from a DIFFERENT seed
with its buffers scrambled (so nothing passes by accident), the DeepSpeed config
of the fixture (``--ds-config``, else ``DIR/ds_config.json``, else
``fixtures/data/deepspeed/NAME/ds_config.json``; ``train_batch_size`` re-derived
for M), ``deepspeed.initialize`` with the same two param groups, then:

1. ``engine.load_checkpoint(DIR, tag=TAG, load_optimizer_states=True,
   load_lr_scheduler_states=True)``; TAG defaults to the content of ``DIR/latest``;
2. gathers through DeepSpeed's own APIs (``collect_truth`` of the generator:
   ``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state`` after
   re-linking the optimizer state of every group, ``GatheredParameters`` at
   stage 3) and compares bit for bit (dtype, shape, torch.equal; plain values
   with ==) with the truth: ``fp32.*``, ``exp_avg.*``, ``exp_avg_sq.*``,
   ``step.*``, ``frozen.*``, ``module.*``, ``buffer.*``, ``lr.*``,
   ``global_steps``, ``global_samples``, ``skipped_steps``, ``tied.*`` and the
   returned client state (``client.*``); for a fixture of the generator's
   OPTIM_FIXTURES (SGD, Adagrad, RMSprop, torch's AdamW) the engine is built
   with that fixture's optimizer and EVERY key of its state is compared
   (``state.<key>.*`` and the list ``state_keys``) instead of Adam's three;
3. runs one more training step on all ranks (finite loss, ``global_steps``
   advances by one).

Rank 0 writes ``{"ok", "world_size", "compared", "mismatches", "trained_step",
"error", ...}``.  Exit status: 0 when the check ran to the end (the verdict is
in the JSON); 1 when it raised (rank 0 still writes the JSON with ``"error"``,
e.g. DeepSpeed refusing a checkpoint saved at another world size); 124 when the
--deadline watchdog fired.  Never hangs: process-group timeout, watchdog thread,
final barrier only on success, ``os._exit``.
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

from _checks import compare_one, leave, start_watchdog, write_result  # noqa: E402  (tests/dist, next to this script)

import deepspeed_models as dm  # noqa: E402

COMPARED_PREFIXES = ("fp32.", "exp_avg.", "exp_avg_sq.", "step.", "frozen.", "module.", "buffer.", "lr.",
                     "tied.", "client.")  # fmt: skip
COMPARED_KEYS = ("global_steps", "global_samples", "skipped_steps")
REQUIRED_PREFIXES = ("fp32.", "exp_avg.", "exp_avg_sq.", "frozen.", "buffer.", "lr.")
# a truth with "state_keys" (fixtures of generate_deepspeed.OPTIM_FIXTURES) holds every key of the
# optimizer's state as state.<key>.<param> instead of Adam's exp_avg/exp_avg_sq/step
ALL_STATES_PREFIXES = ("fp32.", "state.", "frozen.", "module.", "buffer.", "lr.", "tied.", "client.")
ALL_STATES_KEYS = COMPARED_KEYS + ("state_keys",)
ALL_STATES_REQUIRED = ("fp32.", "state.", "frozen.", "buffer.", "lr.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="DeepSpeed save dir (contains <tag>/)")
    ap.add_argument("--fixture", help="fixture name, e.g. z2_bf16_w2")
    ap.add_argument("--truth", help="<name>.truth.pt written by fixtures/generate_deepspeed.py")
    ap.add_argument("--result", required=True, help="JSON result file (written by rank 0)")
    ap.add_argument("--batch", default=None,
                    help="JSON list of {ckpt, fixture, truth}: check each in this one launch (the result "
                         "file then holds {'results': [...]}), saving a DeepSpeed start-up per checkpoint")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: DIR/latest)")
    ap.add_argument("--ds-config", default=None, help="DeepSpeed config JSON (default: see above)")
    ap.add_argument("--init-seed", type=int, default=dm.MODEL_SEED + 1,
                    help="seed for the model before loading (default differs from the fixtures')")  # fmt: skip
    ap.add_argument("--pg-timeout", type=float, default=120.0, help="process group timeout, seconds")
    ap.add_argument("--deadline", type=float, default=600.0, help="kill this process after so many seconds")
    return ap.parse_args(argv)


def _in_scope(k: str, all_states: bool = False) -> bool:
    if all_states:
        return k.startswith(ALL_STATES_PREFIXES) or k in ALL_STATES_KEYS
    return k.startswith(COMPARED_PREFIXES) or k in COMPARED_KEYS


def compare(got: dict, truth: dict) -> tuple[int, list[str]]:
    all_states = "state_keys" in truth
    want_keys = {k for k in truth if _in_scope(k, all_states)}
    got_keys = {k for k in got if _in_scope(k, all_states)}
    mismatches = [f"{k}: missing after load" for k in sorted(want_keys - got_keys)]
    mismatches += [f"{k}: not in truth" for k in sorted(got_keys - want_keys)]
    compared = 0
    for k in sorted(want_keys & got_keys):
        compared += 1
        problem = compare_one(k, got[k], truth[k])
        if problem:
            mismatches.append(problem)
    for pre in ALL_STATES_REQUIRED if all_states else REQUIRED_PREFIXES:
        if not any(k.startswith(pre) for k in want_keys):
            mismatches.append(f"truth has no {pre}* entries")
    if "global_steps" not in want_keys:
        mismatches.append("truth has no global_steps")
    return compared, mismatches


def _find_config(args: argparse.Namespace) -> Path:
    cands = [Path(args.ds_config)] if args.ds_config else []
    import generate_deepspeed as gen

    fixture = gen.fixture_dir(args.fixture) if args.fixture in gen.OPTIM_FIXTURES else \
        REPO / "fixtures" / "data" / "deepspeed" / args.fixture
    cands += [Path(args.ckpt) / "ds_config.json", fixture / "ds_config.json"]
    for c in cands:
        if c.is_file():
            return c
    raise FileNotFoundError(f"no ds_config.json among {[str(c) for c in cands]}")


def _scramble_buffers(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.positions.copy_(model.positions.flip(0))
        model.temperature.fill_(7.0)


def run(args: argparse.Namespace, rank: int, world: int, info: dict) -> dict:
    import deepspeed

    import generate_deepspeed as gen

    t0 = time.time()
    cfg_path = _find_config(args)
    cfg = dm.with_world_size(json.loads(cfg_path.read_text()), world)
    stage = int(cfg["zero_optimization"]["stage"])
    info.update({"ds_config": str(cfg_path), "stage": stage})
    if cfg.get("fp16", {}).get("enabled"):
        dm.allow_fp16_on_cpu()
    tag = args.tag
    if tag is None:
        tag = (Path(args.ckpt) / "latest").read_text().strip()
    info["tag"] = tag
    if not (Path(args.ckpt) / tag).is_dir():
        # DeepSpeed itself only fails with a bare AssertionError here.
        raise FileNotFoundError(f"no checkpoint folder {Path(args.ckpt) / tag}")

    model = dm.make_model(args.init_seed)
    _scramble_buffers(model)
    if args.fixture in gen.OPTIM_FIXTURES:  # the fixture's own optimizer (a client one, or torch_adam)
        engine = gen.initialize(args.fixture, model, cfg)
        info["optimizer"] = type(engine.optimizer.optimizer).__name__
    else:
        groups = dm.param_groups(model)
        engine, _opt, _, _sched = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)

    load_path, client_state = engine.load_checkpoint(
        args.ckpt, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise RuntimeError(f"engine.load_checkpoint({args.ckpt!r}, tag={tag!r}) returned None (nothing loaded)")

    truth = torch.load(args.truth, map_location="cpu", weights_only=True)
    got = gen.collect_truth(engine, stage, all_states="state_keys" in truth)
    for k in truth:
        if k.startswith("client."):
            sub = k[len("client."):]
            if client_state is not None and sub in client_state:
                got[k] = client_state[sub]
    compared, mismatches = (0, [])
    if rank == 0:
        compared, mismatches = compare(got, truth)

    # One more training step on every rank: the loaded state must be usable.
    steps_before = int(engine.global_steps)
    loss = dm.train_step(engine, dm.DATA_SEED)
    local_ok = math.isfinite(loss) and int(engine.global_steps) == steps_before + 1
    flags = torch.tensor([int(local_ok)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    trained_step = bool(flags[0].item() == world)

    return {
        "ok": bool(compared > 0 and not mismatches and trained_step),
        "world_size": world,
        "compared": compared,
        "mismatches": mismatches,
        "trained_step": trained_step,
        "error": None,
        "loss_after_load": loss,
        "loaded_path": str(load_path),
        "seconds": round(time.time() - t0, 3),
    }


def check_case(argv: list[str], rank: int, world: int) -> dict:
    """One case of a launch of several (tests/dist/ds_engine_cases.py): this script's options."""
    import deepspeed

    args = parse_args(argv)
    info = {"fixture": args.fixture, "ckpt": str(args.ckpt), "truth": str(args.truth), "deepspeed": deepspeed.__version__}
    result = run(args, rank, world, info)
    return {**info, **result}


def main() -> None:
    args = parse_args()
    start_watchdog(args.deadline)

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    info = {
        "fixture": args.fixture,
        "ckpt": str(args.ckpt),
        "truth": str(args.truth),
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
    }
    code = 0
    if args.batch:
        results = []
        for item in json.loads(Path(args.batch).read_text()):
            one = argparse.Namespace(**{**vars(args), **item})
            one_info = {**info, "fixture": item["fixture"], "ckpt": item["ckpt"], "truth": item["truth"]}
            try:
                res = run(one, rank, world, one_info)
            except BaseException as e:  # report this one, go on with the next
                res = _failure(rank, world, e)
                code = 1
            res.update({k: v for k, v in one_info.items() if k not in res})
            results.append(res)
        if rank == 0:
            write_result(args.result, {"results": results, "world_size": world})
            for res in results:
                print(json.dumps({k: res.get(k) for k in ("fixture", "ok", "compared", "trained_step", "error")}),
                      flush=True)
        leave(code)
    if not (args.ckpt and args.fixture and args.truth):
        raise SystemExit("--ckpt, --fixture and --truth are required without --batch")
    try:
        result = run(args, rank, world, info)
    except BaseException as e:  # report, then leave without hanging
        code = 1
        result = _failure(rank, world, e)
    result.update({k: v for k, v in info.items() if k not in result})
    if rank == 0:
        write_result(args.result, result)
        print(json.dumps({k: result[k] for k in ("ok", "world_size", "compared", "trained_step", "error")}), flush=True)
        for m in result["mismatches"][:20]:
            print("MISMATCH", m, flush=True)
    leave(code)


def _failure(rank: int, world: int, exc: BaseException) -> dict:
    result = {"ok": False, "world_size": world, "compared": 0, "mismatches": [], "trained_step": False,
              "error": f"rank {rank}: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    print(result["error"], file=sys.stderr, flush=True)
    return result



if __name__ == "__main__":
    main()
