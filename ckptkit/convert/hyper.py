"""Which optimizer each side runs, and its param groups and steps in that side's convention.

A torch optimizer (a torch source; DeepSpeed with `"torch_adam": true`, with a torch.optim type
such as "SGD", or with no "optimizer" section, i.e. the client optimizer given to
`deepspeed.initialize`) keeps torch's own state dict: its state keys and group hyperparameters
are carried as they are, and torch's step is a 0-d float32 tensor per parameter.

DeepSpeed's own optimizers (FusedAdam / DeepSpeedCPUAdam for "Adam"/"AdamW", FusedLamb, FusedLion)
keep an int step per group, `bias_correction` in each group and whether weight decay is decoupled
in the optimizer itself (`adam_w_mode`). Converting maps one onto the other without losing
anything a round trip needs: torch's keys pass through DeepSpeed untouched, DeepSpeed's own keys
are dropped on the way back (`decoupled_weight_decay` carries adam_w_mode). A target that cannot
hold the source's state (DeepSpeed's Adam for SGD's momentum_buffer) is refused, naming both.
"""

from __future__ import annotations

import copy
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from ..errors import UnsupportedError, quote
from ..lazy_torch import is_tensor
from ..torch_types import SmallTensor

if TYPE_CHECKING:
    import torch

# torch.optim.AdamW defaults for keys a DeepSpeed group lacks (torch >= 2.4 adds all of them)
TORCH_ADAMW_DEFAULTS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}
DEEPSPEED_ONLY = ("bias_correction", "step", "adam_w_mode", "torch_adam")
ADAM_TYPES = ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam")
# DeepSpeed's own optimizers: lower-case config type -> (what runs, the tensors it keeps per parameter)
DS_OWN: dict[str, tuple[str, frozenset[str]]] = {
    **{t: ("DeepSpeed's FusedAdam / DeepSpeedCPUAdam", frozenset({"exp_avg", "exp_avg_sq"})) for t in ADAM_TYPES},
    "lamb": ("DeepSpeed's FusedLamb", frozenset({"exp_avg", "exp_avg_sq"})),
    "lion": ("DeepSpeed's FusedLion", frozenset({"exp_avg"})),
}
# DeepSpeed optimizers whose state ckptkit does not know (never guessed)
DS_UNKNOWN = ("onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw", "musgd", "muon")
# torch.optim classes (lower-case) -> the per-parameter state keys they keep
TORCH_STATES: dict[str, frozenset[str]] = {
    "sgd": frozenset({"momentum_buffer"}),
    "adam": frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "adamw": frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "adagrad": frozenset({"step", "sum"}),
    "rmsprop": frozenset({"step", "square_avg", "momentum_buffer", "grad_avg"}),
    "adadelta": frozenset({"step", "square_avg", "acc_delta"}),
    "adamax": frozenset({"step", "exp_avg", "exp_inf"}),
    "nadam": frozenset({"step", "mu_product", "exp_avg", "exp_avg_sq"}),
    "radam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "asgd": frozenset({"step", "eta", "mu", "ax"}),
    "rprop": frozenset({"step", "prev", "step_size"}),
}


@dataclass(frozen=True)
class DsOptimizer:
    """The optimizer a DeepSpeed config makes: `kind` is its lower-case type, None when the config
    has no "optimizer" section (the client optimizer passed to deepspeed.initialize)."""

    kind: str | None
    params: dict = field(default_factory=dict)
    type_name: str | None = None  # as the config spells it

    @property
    def own(self) -> bool:
        """DeepSpeed's own implementation (int step per group, bias_correction), not torch's."""
        if self.kind in ADAM_TYPES:
            return not bool(self.params.get("torch_adam", False))
        return self.kind in DS_OWN

    @property
    def adam_w_mode(self) -> bool:
        return True if self.kind == "adamw" else bool(self.params.get("adam_w_mode", True))

    def holds(self) -> frozenset[str] | None:
        """The per-parameter state keys it keeps (step aside), or None when unknown (a client optimizer)."""
        if self.own:
            return DS_OWN[self.kind][1]
        if self.kind in ADAM_TYPES:
            return TORCH_STATES["adamw"]
        return TORCH_STATES.get(self.kind or "")

    def describe(self) -> str:
        if self.kind is None:
            return 'the client optimizer (the DeepSpeed config has no "optimizer" section)'
        what = (
            DS_OWN[self.kind][0]
            if self.own
            else ("torch.optim.AdamW (torch_adam)" if self.kind in ADAM_TYPES else f"torch.optim.{self.type_name}")
        )
        return f"the DeepSpeed config's optimizer {quote(str(self.type_name))} ({what})"


def ds_optimizer(ds_config: dict | None) -> DsOptimizer:
    """The optimizer a DeepSpeed config names (see DsOptimizer)."""
    opt = (ds_config or {}).get("optimizer")
    if not isinstance(opt, dict) or "type" not in opt:
        return DsOptimizer(None)
    name = str(opt.get("type"))
    kind = name.lower()
    if kind in DS_UNKNOWN:
        raise UnsupportedError(
            f"the DeepSpeed config's optimizer {quote(name)} keeps state ckptkit does not know "
            f"how to map; convert to a config with an Adam, Lamb, "
            f"Lion or torch.optim optimizer, or none (a client optimizer)"
        )
    return DsOptimizer(kind, dict(opt.get("params") or {}), name)


def source_is_ds_own(from_deepspeed: bool, ds_config: dict | None, groups: list[dict]) -> bool:
    """A DeepSpeed source written by DeepSpeed's own Adam-style optimizer (int steps, bias_correction).
    Its stored config says; without one, DeepSpeed's own groups carry bias_correction."""
    if not from_deepspeed:
        return False
    if ds_config is not None and isinstance((ds_config or {}).get("optimizer"), dict):
        opt = ds_optimizer(ds_config)
        return opt.own and opt.kind in ADAM_TYPES  # Lamb, Lion: no torch equivalent, carried as they are
    return any("bias_correction" in g for g in groups)


def guess_torch_name(keys: Iterable[str]) -> str:
    """A human name for the optimizer that keeps these state keys ('SGD with momentum', ...)."""
    keys = frozenset(keys) - {"step"}
    names = {"sgd": "SGD with momentum", "adamw": "Adam/AdamW", "adagrad": "Adagrad", "rmsprop": "RMSprop"}
    for kind, label in names.items():
        if keys and keys <= TORCH_STATES[kind]:
            return label
    return "the source optimizer"


def check_target_holds(target: DsOptimizer, keys: Iterable[str]) -> None:
    """Refuse, in one sentence naming both, a target optimizer that cannot hold the source's state."""
    keys = frozenset(keys)
    holds = target.holds()
    if holds is None:
        return
    extra = sorted(keys - holds - {"step"})
    if extra:
        kept = ", ".join(sorted(holds - {"step"})) + (" and a step" if "step" in holds or target.own else "")
        raise UnsupportedError(
            f"{target.describe()} keeps {kept} per parameter; it cannot "
            f"hold the state of {guess_torch_name(keys)} ({', '.join(extra)}): use that optimizer in the DeepSpeed "
            f'config (its torch.optim type), or no "optimizer" section to pass it to deepspeed.initialize'
        )


def torch_groups(groups: list[dict], source_own: bool, adam_w_mode_: bool = True) -> list[dict]:
    """Groups as the torch optimizer's state_dict holds them (without "params"): a DeepSpeed-own
    Adam source becomes torch.optim.AdamW's groups; anything else is carried as it is."""
    out = []
    for g in groups:
        g = {k: copy.deepcopy(v) for k, v in g.items() if not (source_own and k in DEEPSPEED_ONLY)}
        if source_own:
            if g.get("bias_correction") is False:
                raise UnsupportedError("a DeepSpeed Adam group without bias correction has no torch AdamW equivalent")
            for k, v in TORCH_ADAMW_DEFAULTS.items():
                g.setdefault(k, v)
            g.setdefault("decoupled_weight_decay", adam_w_mode_)
        out.append(g)
    return out


def deepspeed_groups(groups: list[dict], target: DsOptimizer) -> list[dict]:
    """Groups for the target DeepSpeed optimizer: torch's keys kept, DeepSpeed's own added."""
    out = []
    for g in groups:
        g = copy.deepcopy(g)
        if (
            target.kind in ADAM_TYPES
            and "decoupled_weight_decay" in g
            and bool(g["decoupled_weight_decay"]) != target.adam_w_mode
        ):
            raise UnsupportedError(
                f"the source optimizer {'decouples' if g['decoupled_weight_decay'] else 'does not decouple'} "
                f"weight decay but the DeepSpeed config's optimizer "
                f"{'does not' if g['decoupled_weight_decay'] else 'does'}; use type AdamW (or Adam) accordingly"
            )
        if target.own and target.kind in ADAM_TYPES:
            g.setdefault("bias_correction", True)
        out.append(g)
    return out


def torch_step(value: Any) -> "torch.Tensor | SmallTensor":
    """torch's per-parameter step: a 0-d float32 tensor (kept as is when already a tensor), as a
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


def deepspeed_step(value: Any, target: DsOptimizer) -> Any:
    """DeepSpeed's own optimizers keep an int step; a torch optimizer keeps torch's float tensor."""
    if not target.own:
        return torch_step(value)
    v = step_number(value)
    if float(v) != int(float(v)):
        raise UnsupportedError(f"optimizer step {quote(str(v))} is not a whole number")
    return int(float(v))
