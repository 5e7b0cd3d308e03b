"""Multi-process check that a DCP checkpoint loads into FSDP2 with torch's own APIs.

    torchrun --nproc_per_node M tests/dist/fsdp2_load_check.py \
        --ckpt DIR --truth TRUTH.pt --result OUT.json

M may differ from the world size the checkpoint was saved at (DCP reshards on
load). ``--optim sgd|adagrad|rmsprop`` builds that torch optimizer (``fixtures/models.py``
OPTIMIZERS, the recipe of the ``fsdp2_<kind>_w2`` fixtures) instead of AdamW, and checks its
own hyperparameters. ``--model ds`` uses ``fixtures/deepspeed_models.py``'s DSToyModel instead (the model
of the DeepSpeed fixtures, with a frozen block), sharded and optimised as
``fixtures/generate_convert.py`` does, to load checkpoints converted from DeepSpeed.  Every rank builds ``fixtures/models.py``'s ToyModel (from a DIFFERENT
seed, with its buffers scrambled, so nothing can pass by accident), applies
FSDP2 exactly like the fixture generator, builds AdamW with the same two param
groups, then:

1. ``msd, osd = get_state_dict(model, optim)`` -- in torch 2.13 this also
   initialises the (lazy) AdamW state through ``_init_optim_state``: a step with
   zero grads and lr temporarily 0, so ``optim.state`` holds DTensor
   ``exp_avg``/``exp_avg_sq`` and ``step`` for DCP to load into;
2. ``dcp.load({"model": msd, "optim": osd}, checkpoint_id=DIR)``;
3. ``set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)``;
4. gathers ``get_state_dict(..., full_state_dict=True, cpu_offload=True)``,
   flattens it with DCP's ``flatten_state_dict`` and compares every ``model.*`` and
   ``optim.*`` entry of the truth file bit for bit (dtype, shape, torch.equal;
   plain values with ==, including param_groups lr/betas/eps/weight_decay);
5. runs one more training step (all ranks) to show the loaded state is usable.

Rank 0 writes ``{"ok", "world_size", "compared", "mismatches", "trained_step", ...}``.
Exit status: 0 when the check ran to the end (the verdict is in the JSON, ``ok``
may be false); 1 when it crashed (rank 0 still tries to write the JSON with
``"error"``); 124 when the --deadline watchdog fired.  Never hangs: the process
group has a timeout, a watchdog thread kills the process after --deadline
seconds, and workers leave with ``os._exit`` after a final barrier.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _checks import compare_one, leave, start_watchdog, write_result  # noqa: E402  (tests/dist, next to this script)

import models  # noqa: E402

HYPERPARAMS = {  # group hyperparameters that must be in the truth (and equal after the load)
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
    "adagrad": ("lr", "lr_decay", "eps", "initial_accumulator_value", "weight_decay"),
    "rmsprop": ("lr", "alpha", "eps", "momentum", "centered", "weight_decay"),
}


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="DCP checkpoint directory")
    ap.add_argument("--truth", required=True, help="flat ground-truth .pt written by fixtures/generate.py")
    ap.add_argument("--result", required=True, help="JSON result file (written by rank 0)")
    ap.add_argument("--init-seed", type=int, default=None,
                    help="seed for the model before loading (default differs from the fixtures')")  # fmt: skip
    ap.add_argument("--model", choices=["toy", "ds"], default="toy",
                    help="toy: fixtures/models.py ToyModel; ds: deepspeed_models.DSToyModel")
    ap.add_argument("--optim", choices=sorted(HYPERPARAMS), default="adamw",
                    help="the torch optimizer of the checkpoint (default adamw; with --model ds: "
                         "deepspeed_models.client_optimizer's)")
    ap.add_argument("--pg-timeout", type=float, default=120.0, help="process group timeout, seconds")
    ap.add_argument("--deadline", type=float, default=300.0, help="kill this process after so many seconds")
    return ap.parse_args()


def compare(flat: dict, truth: dict, hyperparams: tuple[str, ...] = HYPERPARAMS["adamw"]) -> tuple[int, list[str]]:
    """Compare every model.* / optim.* entry; returns (compared, mismatches)."""
    scope = ("model.", "optim.")
    want_keys = {k for k in truth if k.startswith(scope)}
    got_keys = {k for k in flat if k.startswith(scope)}
    mismatches = [f"{k}: missing after load" for k in sorted(want_keys - got_keys)]
    mismatches += [f"{k}: not in truth" for k in sorted(got_keys - want_keys)]
    compared = 0
    for k in sorted(want_keys & got_keys):
        compared += 1
        problem = compare_one(k, flat[k], truth[k])
        if problem:
            mismatches.append(problem)
    # The hyperparameters must be there at all (not just equal when present).
    groups = sorted({k.split(".")[2] for k in want_keys if k.startswith("optim.param_groups.")})
    if not groups:
        mismatches.append("truth has no optim.param_groups.* entries")
    for g in groups:
        for h in hyperparams:
            k = f"optim.param_groups.{g}.{h}"
            if k not in want_keys:
                mismatches.append(f"{k}: missing in truth")
    return compared, mismatches


def _scramble_buffers(model: torch.nn.Module) -> None:
    # Buffers are constants of the model; change them so a skipped load shows up.
    with torch.no_grad():
        model.positions.copy_(model.positions.flip(0))
        if hasattr(model, "keep"):
            model.keep.logical_not_()
        model.temperature.fill_(7.0)


class _Recipe:
    """Model, sharding, optimizer and training step of --model."""

    def __init__(self, kind: str, optim: str = "adamw") -> None:
        if kind == "toy":
            self.make_model, self.shard = models.make_model, models.shard_fsdp2
            self.make_optimizer = lambda m: models.make_optimizer(m, kind=optim)
            self.train = lambda m, o, n: models.train_steps(m, o, n, models.DATA_SEED)
            self.default_seed = models.MODEL_SEED + 1
        else:
            import deepspeed_models as dm
            import generate_convert as gc

            self.make_model, self.shard, self.make_optimizer = dm.make_model, gc.shard_fsdp2, gc.make_optimizer
            if optim != "adamw":  # the client torch optimizer of the DeepSpeed optimizer fixtures
                name = {"sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}[optim]
                self.make_optimizer = lambda m: dm.client_optimizer(name, dm.param_groups(m))
            self.train = gc.train
            self.default_seed = dm.MODEL_SEED + 1


def run(args: argparse.Namespace, rank: int, world: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    t0 = time.time()
    mesh = init_device_mesh("cpu", (world,))
    recipe = _Recipe(args.model, args.optim)
    model = recipe.make_model(args.init_seed if args.init_seed is not None else recipe.default_seed)
    _scramble_buffers(model)
    recipe.shard(model, mesh)
    optim = recipe.make_optimizer(model)
    if optim.state and args.optim != "adagrad":  # Adagrad fills its state in __init__
        raise AssertionError(f"fresh {args.optim} unexpectedly has state")

    # get_state_dict initialises the lazy AdamW state (zero grads, lr 0) so that
    # the optimizer state dict has DTensors for DCP to load into.
    msd, osd = get_state_dict(model, optim)
    n_state = len(osd.get("state", {}))
    if n_state == 0:
        raise AssertionError("get_state_dict did not initialise the optimizer state")

    dcp.load({"model": msd, "optim": osd}, checkpoint_id=args.ckpt)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)

    full_msd, full_osd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )

    compared, mismatches = 0, []
    if rank == 0:
        flat, _ = flatten_state_dict({"model": full_msd, "optim": full_osd})
        truth = torch.load(args.truth, map_location="cpu", weights_only=True)
        compared, mismatches = compare(dict(flat), truth, HYPERPARAMS[args.optim])

    # One more training step on every rank: the loaded state must be usable.
    before = [p.detach().to_local().clone() for p in model.parameters() if p.requires_grad]
    steps_before = [float(s["step"]) for s in optim.state.values() if "step" in s]  # SGD keeps none
    losses = recipe.train(model, optim, 1)
    changed = any(not torch.equal(b, p.detach().to_local())
                  for b, p in zip(before, [p for p in model.parameters() if p.requires_grad]))
    steps_after = [float(s["step"]) for s in optim.state.values() if "step" in s]
    local_ok = (
        math.isfinite(losses[0])
        and len(steps_after) == len(steps_before)
        and all(a == b + 1 for a, b in zip(steps_after, steps_before))
    )
    flags = torch.tensor([int(local_ok), int(changed)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    # every rank finite & step advanced; at least one rank saw its shard change
    trained_step = bool(flags[0].item() == world and flags[1].item() > 0)

    return {
        "ok": bool(compared > 0 and not mismatches and trained_step),
        "world_size": world,
        "compared": compared,
        "mismatches": mismatches,
        "trained_step": trained_step,
        "loss_after_load": losses[0],
        "ckpt": str(args.ckpt),
        "truth": str(args.truth),
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 3),
    }


def main() -> None:
    args = _parse()
    start_watchdog(args.deadline)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    code = 0
    try:
        result = run(args, rank, world)
    except BaseException as e:  # report, then leave without hanging
        code = 1
        result = {
            "ok": False,
            "world_size": world,
            "compared": 0,
            "mismatches": [],
            "trained_step": False,
            "error": f"rank {rank}: {type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
        print(result["error"], file=sys.stderr, flush=True)
    if rank == 0:
        write_result(args.result, result)
        print(json.dumps({k: result[k] for k in ("ok", "world_size", "compared", "trained_step")}), flush=True)
        for m in result["mismatches"][:20]:
            print("MISMATCH", m, flush=True)
    leave(code)


if __name__ == "__main__":
    main()
