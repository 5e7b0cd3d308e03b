"""What a framework must hold after loading a converted checkpoint, derived from the other
framework's truth file (both written by the frameworks themselves, see fixtures/).

ds_truth (generate_deepspeed.py: safe_get_full_fp32_param / safe_get_full_optimizer_state)
  -> the flat get_state_dict(full_state_dict=True) an FSDP2 job holds after loading zero -> dcp;
torch_truth (generate_convert.py: get_state_dict(full_state_dict=True))
  -> the keys ds_load_check.py gathers through DeepSpeed's APIs after loading dcp -> zero.
The mapping is the documented contract of `ckptkit convert` (docs/cli.md#convert).
"""

from __future__ import annotations

import sys

import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "fixtures"))
import deepspeed_models as dm  # noqa: E402

TORCH_DEFAULTS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
# DeepSpeed truth key -> torch recipe key, for the values that map one to one
SAME_VALUES = {
    "fp32.{n}": "model.{n}",
    "exp_avg.{n}": "optim.state.{n}.exp_avg",
    "exp_avg_sq.{n}": "optim.state.{n}.exp_avg_sq",
}


def model_roles() -> tuple[list[list[str]], list[str], list[str], dict[str, str]]:
    """(param groups by name, frozen, buffers, ties) of DSToyModel, as deepspeed_models groups them."""
    model = dm.make_model()
    groups: list[list[str]] = [[], []]
    frozen = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            frozen.append(name)
        else:
            groups[1 if dm.is_no_decay(name, p) else 0].append(name)
    buffers = [n for n, _ in model.named_buffers()]
    return groups, frozen, buffers, {"lm_head.weight": "embed.weight"}


def torch_truth_from_ds(ds: dict, cfg: dict) -> dict:
    groups, frozen, buffers, ties = model_roles()
    out: dict = {}
    for g, names in enumerate(groups):
        for n in names:
            for ds_key, torch_key in SAME_VALUES.items():
                out[torch_key.format(n=n)] = ds[ds_key.format(n=n)]
            out[f"optim.state.{n}.step"] = torch.tensor(float(ds[f"step.{n}"]), dtype=torch.float32)
        params = cfg["optimizer"]["params"]
        hyper = {
            "lr": ds[f"lr.{g}"],
            "betas": list(params["betas"]),
            "eps": params["eps"],
            "weight_decay": dm.WEIGHT_DECAY if g == 0 else 0.0,
            **TORCH_DEFAULTS,
            "params": names,
        }
        for k, v in hyper.items():
            out[f"optim.param_groups.{g}.{k}"] = v
    for n in frozen:
        out[f"model.{n}"] = ds[f"frozen.{n}"].float()
    for b in buffers:
        v = ds[f"buffer.{b}"]
        out[f"model.{b}"] = v.float() if v.is_floating_point() else v
    for alias, owner in ties.items():
        out[f"model.{alias}"] = out[f"model.{owner}"]
    return out


def ds_truth_from_torch(t: dict, cfg: dict, extra: dict) -> dict:
    groups, frozen, buffers, ties = model_roles()
    precision = torch.float32
    if (cfg.get("bf16") or {}).get("enabled"):
        precision = torch.bfloat16
    elif (cfg.get("fp16") or {}).get("enabled"):
        precision = torch.float16
    out: dict = {}
    for g, names in enumerate(groups):
        for n in names:
            for ds_key, torch_key in SAME_VALUES.items():
                out[ds_key.format(n=n)] = t[torch_key.format(n=n)]
            out[f"step.{n}"] = int(t[f"optim.state.{n}.step"].item())
            out[f"module.{n}"] = t[f"model.{n}"].to(precision)
        out[f"lr.{g}"] = t[f"optim.param_groups.{g}.lr"]
    for n in frozen:
        out[f"frozen.{n}"] = t[f"model.{n}"].to(precision)
        out[f"module.{n}"] = out[f"frozen.{n}"]
    for b in buffers:
        out[f"buffer.{b}"] = t[f"model.{b}"]
    for alias, owner in ties.items():
        out[f"tied.{alias}"] = owner
    steps = int(t[f"optim.state.{groups[0][0]}.step"].item())
    out["global_steps"] = steps
    out["global_samples"] = steps * int(cfg["train_batch_size"])
    out["skipped_steps"] = 0
    for k, v in extra.items():
        out[f"client.{k}"] = v
    return out
