"""Param-group hyperparameters and steps in each backend's convention.

torch's AdamW keeps a 0-d float32 `step` per parameter and a fixed set of group keys (its
`load_state_dict` needs them all); DeepSpeed's Adam (FusedAdam / DeepSpeedCPUAdam) keeps an int
step per group, `bias_correction` in each group and whether weight decay is decoupled in the
optimizer itself (`adam_w_mode`). Converting maps one onto the other without losing anything a
round trip needs: torch's keys pass through DeepSpeed untouched, DeepSpeed's own keys are
dropped on the way back (`decoupled_weight_decay` carries adam_w_mode).
"""
from __future__ import annotations

import copy
import struct
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedError, quote
from ..lazy_torch import is_tensor
from ..torch_types import SmallTensor

if TYPE_CHECKING:
    import torch

# torch.optim.AdamW defaults for keys a DeepSpeed group lacks (torch >= 2.4 adds all of them)
TORCH_ADAMW_DEFAULTS: dict[str, Any] = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                                        "differentiable": False, "fused": None}
DEEPSPEED_ONLY = ("bias_correction", "step", "adam_w_mode", "torch_adam")
ADAM_TYPES = ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam")


def ds_optimizer(ds_config: dict | None) -> tuple[str, dict]:
    """(lower-case type, params) of the config's optimizer; ('adamw', {}) when none is configured."""
    opt = (ds_config or {}).get("optimizer") or {}
    kind = str(opt.get("type", "AdamW")).lower()
    params = opt.get("params") or {}
    if kind not in ADAM_TYPES:
        raise UnsupportedError(f"the DeepSpeed config's optimizer {quote(str(opt.get('type')))} is not Adam-style; only "
                               f"Adam/AdamW state (exp_avg, exp_avg_sq, step) converts between backends")
    return kind, params


def adam_w_mode(ds_config: dict | None) -> bool:
    kind, params = ds_optimizer(ds_config)
    return True if kind == "adamw" else bool(params.get("adam_w_mode", True))


def uses_torch_adam(ds_config: dict | None) -> bool:
    return bool(ds_optimizer(ds_config)[1].get("torch_adam", False))


def torch_groups(groups: list[dict], ds_config: dict | None, from_deepspeed: bool) -> list[dict]:
    """Groups as torch.optim.AdamW's state_dict holds them (without "params")."""
    out = []
    for g in groups:
        g = {k: copy.deepcopy(v) for k, v in g.items() if not (from_deepspeed and k in DEEPSPEED_ONLY)}
        if from_deepspeed:
            if g.get("bias_correction") is False:
                raise UnsupportedError("a DeepSpeed Adam group without bias correction has no torch AdamW equivalent")
            for k, v in TORCH_ADAMW_DEFAULTS.items():
                g.setdefault(k, v)
            g.setdefault("decoupled_weight_decay", adam_w_mode(ds_config))
        out.append(g)
    return out


def deepspeed_groups(groups: list[dict], ds_config: dict | None) -> list[dict]:
    """Groups for a DeepSpeed optimizer: torch's keys kept, DeepSpeed's added."""
    out = []
    for g in groups:
        g = copy.deepcopy(g)
        if "decoupled_weight_decay" in g and bool(g["decoupled_weight_decay"]) != adam_w_mode(ds_config):
            raise UnsupportedError(
                f"the source optimizer {'decouples' if g['decoupled_weight_decay'] else 'does not decouple'} "
                f"weight decay but the DeepSpeed config's optimizer "
                f"{'does not' if g['decoupled_weight_decay'] else 'does'}; use type AdamW (or Adam) accordingly")
        if not uses_torch_adam(ds_config):
            g.setdefault("bias_correction", True)
        out.append(g)
    return out


def torch_step(value: Any) -> "torch.Tensor | SmallTensor":
    """AdamW's per-parameter step: a 0-d float32 tensor (kept as is when already a tensor), as a
    SmallTensor when built from a number (written without torch)."""
    if isinstance(value, SmallTensor):
        if value.numel != 1:
            raise UnsupportedError(f"optimizer step {quote(str(value))} is not a single number")
        return SmallTensor(value.dtype, (), value.data)
    if is_tensor(value):
        return value.detach().clone().reshape(())
    return SmallTensor("float32", (), struct.pack("<f", float(value)))


def step_number(value: Any) -> Any:
    """A step as a Python number, whichever form it has (int, float, SmallTensor, torch tensor)."""
    if isinstance(value, SmallTensor):
        try:
            return value.item()
        except UnsupportedError:
            raise UnsupportedError(f"optimizer step {quote(str(value))} is not a single number") from None
    if is_tensor(value):
        return value.item()
    return value


def deepspeed_step(value: Any, ds_config: dict | None) -> Any:
    """DeepSpeed's Adam keeps an int step; with torch_adam it is torch's float tensor."""
    if uses_torch_adam(ds_config):
        return torch_step(value)
    v = step_number(value)
    if float(v) != int(float(v)):
        raise UnsupportedError(f"optimizer step {quote(str(v))} is not a whole number")
    return int(float(v))
