"""What Megatron's pickled `args` (an argparse.Namespace, read as data by the restricted loader)
say about a checkpoint: the parallel sizes it was saved at, the layer count and the ties.

Megatron-LM pickles its whole command line into every checkpoint (`common.pt` of a torch_dist
save, each legacy `model_optim_rng.pt`). Only the fields below are read; a field that is absent
(an older Megatron) is None, never guessed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ...safeload import Inert

NAMESPACE = "argparse.Namespace"


@dataclass(frozen=True)
class MegatronArgs:
    """The layout and model facts Megatron's `args` record."""

    tp: int | None
    pp: int | None
    ep: int | None
    cp: int | None
    dp: int | None
    world_size: int | None
    num_layers: int | None
    tied: bool | None  # the output layer shares the word embedding
    swiglu: bool | None
    query_groups: int | None
    use_distributed_optimizer: bool | None
    ckpt_format: str | None

    @property
    def model_parallel(self) -> bool:
        """Saved split over tensor or pipeline ranks: one rank's file is part of the model."""
        return (self.tp or 1) > 1 or (self.pp or 1) > 1

    def layout(self) -> str:
        """`tp 2 x pp 1 x ep 1 x dp 2`: the sizes the args give."""
        sizes = (("tp", self.tp), ("pp", self.pp), ("ep", self.ep), ("cp", self.cp), ("dp", self.dp))
        return " x ".join(f"{n} {v}" for n, v in sizes if v is not None and (n != "cp" or v > 1))

    def as_json(self) -> dict:
        return asdict(self)


def fields_of(value: Any) -> dict[str, Any] | None:
    """The fields of a pickled argparse.Namespace stand-in, or None when `value` is not one."""
    if not isinstance(value, Inert) or getattr(type(value), "_qualname", None) != NAMESPACE:
        return None
    return {k: v for k, v in vars(value).items() if not k.startswith("_")}


def _int(fields: dict, name: str) -> int | None:
    value = fields.get(name)
    return value if type(value) is int else None


def _bool(fields: dict, name: str) -> bool | None:
    value = fields.get(name)
    return value if type(value) is bool else None


def megatron_args(value: Any) -> MegatronArgs | None:
    """The facts a Megatron `args` Namespace records, or None when `value` is no Namespace."""
    fields = fields_of(value)
    if fields is None:
        return None
    untie = _bool(fields, "untie_embeddings_and_output_weights")
    fmt = fields.get("ckpt_format")
    return MegatronArgs(
        tp=_int(fields, "tensor_model_parallel_size"),
        pp=_int(fields, "pipeline_model_parallel_size"),
        ep=_int(fields, "expert_model_parallel_size"),
        cp=_int(fields, "context_parallel_size"),
        dp=_int(fields, "data_parallel_size"),
        world_size=_int(fields, "world_size"),
        num_layers=_int(fields, "num_layers"),
        tied=None if untie is None else not untie,
        swiglu=_bool(fields, "swiglu"),
        query_groups=_int(fields, "num_query_groups"),
        use_distributed_optimizer=_bool(fields, "use_distributed_optimizer"),
        ckpt_format=fmt if type(fmt) is str else None,
    )
