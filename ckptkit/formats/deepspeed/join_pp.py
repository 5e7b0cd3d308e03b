"""The join over pp: a pipeline's stages into one model (read.py's join after ep, before tp).

Stages saved as layer files (PipelineModule, pipeline.py reads each stage with its layer files)
are joined by `merge_stage`: a tied module's copies on later stages kept aside for verify, param
groups joined by position. Stages saved as mp ranks by `join_rank_stages`: a mixture-of-experts
model inside a DeepSpeed PipelineModule (ZeRO 1/2), which DeepSpeed 0.19 saves the MoE way, not
the pipeline way (the engine's _save_moe_checkpoint; fixtures/generate_ds_pp_moe.py): no
`layer_file(XX)` files, but per stage s an ordinary MoE checkpoint under model-parallel rank s:
  model_file(s)                       stage s's module (PipelineModule names `<layer>.<param>`),
                                      checkpoint_parallel_dimensions {pp_degree P, tp_degree 1}
  expert_file(L, G, s)
                                      stage s's MoE layer L (counted per stage), expert G
  optim_file(d, mp=s)
So each stage is read as a MoE checkpoint (moe.py) and the stages are joined by name: their
parameter names are disjoint (the global layer index leads each), every tensor gets
attrs["parallel"]["pp"] = {"stage", "size"} beside its "ep". moe_stages.py (the writer's pp split) writes one at a
new pp, ep and dp (at a new pp the layers move and the expert files' per-stage MoE layer ids are
renumbered).
"""

from __future__ import annotations

from ...errors import FormatError, UnsupportedError, quote
from ...index.types import CheckpointIndex, ObjectEntry, TensorEntry
from ...storage.source import Source
from .files import ZeroFiles
from .names import layer_file, mp_rank
from .native import Copies


def recorded_pp(sub: CheckpointIndex) -> tuple[int, int] | None:
    """(pp_degree, tp_degree) the model-states file records, None when it records no pipeline."""
    obj = sub.objects.get("ds.checkpoint_parallel_dimensions")
    dims = obj.data if obj is not None else None
    if not isinstance(dims, dict):
        return None
    pp, tp = dims.get("pp_degree"), dims.get("tp_degree", 1)
    if not isinstance(pp, int) or isinstance(pp, bool) or pp <= 1:
        return None
    return pp, tp if isinstance(tp, int) and not isinstance(tp, bool) else 1


def join_rank_stages(
    source: Source, files: ZeroFiles, subs: dict[int, CheckpointIndex]
) -> tuple[CheckpointIndex, dict[int, dict[str, int]]]:
    """One index of the stages' MoE checkpoints (mp rank = stage), and each stage's MoE layers' expert counts."""
    label = source.label(files.prefix + files.model_files[min(files.model_files)])
    pp, tp = recorded_pp(subs[0]) or (0, 1)
    if tp != 1:
        raise UnsupportedError(
            f"{label}: a mixture-of-experts PipelineModule with tensor parallelism (pp_degree "
            f"{pp}, tp_degree {tp}) is not supported yet"
        )
    if pp != len(subs):
        raise FormatError(
            f"{label}: checkpoint_parallel_dimensions.pp_degree says {pp} pipeline stages, but the "
            f"tag folder has model-states files of {len(subs)} ({mp_rank(0)}..{mp_rank(len(subs) - 1)})"
        )
    for stage, sub in subs.items():
        if "deepspeed_moe" not in sub.metadata:
            name = files.model_parallel[stage].model_files[min(files.model_parallel[stage].model_files)]
            raise FormatError(
                f"{source.label(files.prefix + name)}: pipeline stage {stage} of a mixture-of-experts "
                f"PipelineModule checkpoint has no expert files (DeepSpeed saves a pipeline without "
                f"MoE layers as {layer_file('XX')} files)"
            )
    first = subs[0]
    dp = int(first.metadata.get("deepspeed", {}).get("world_size") or 1)
    index = CheckpointIndex(format=first.format, root=first.root, world_size=pp * dp)
    counts: dict[str, int] = {}
    for stage, sub in subs.items():
        index.files.update(sub.files)
        index.checks.extend(sub.checks)
        for key, entry in sub.tensors.items():
            if key in index.tensors:
                raise FormatError(
                    f"{label}: {quote(key)} is on pipeline stages {_stage_of(index, key)} and {stage}; "
                    f"PipelineModule names are unique across stages"
                )
            index.add_tensor(
                TensorEntry(
                    entry.key,
                    entry.dtype,
                    entry.shape,
                    list(entry.pieces),
                    path=entry.path,
                    attrs={
                        **entry.attrs,
                        "parallel": {**entry.attrs.get("parallel", {}), "pp": {"stage": stage, "size": pp}},
                    },
                )
            )
        counts.update(sub.metadata["deepspeed_moe"]["num_experts"])
    for key, obj in first.objects.items():
        if key.startswith("optim.param_groups.") and key.endswith(".params"):
            joined = [n for sub in subs.values() for n in (sub.objects[key].data if key in sub.objects else [])]
            obj = ObjectEntry(obj.key, joined, path=obj.path)
        index.add_object(obj)
    index.step = first.step
    index.metadata.update({k: v for k, v in first.metadata.items()})
    moe = first.metadata["deepspeed_moe"]
    index.metadata["deepspeed_moe"] = {**moe, "num_experts": counts}
    index.metadata["parallel"] = {"pp": pp, "ep": moe["ep_size"], "dp": dp}
    return index, {s: dict(sub.metadata["deepspeed_moe"]["num_experts"]) for s, sub in subs.items()}


def merge_stage(
    index: CheckpointIndex,
    part: CheckpointIndex,
    stage: int,
    pp: int,
    owner: dict[str, int],
    replicas: Copies,
) -> None:
    """A stage's entries into the pipeline's index, each marked with its stage; a tied module's
    (already given by a lower stage) kept aside as a replica, param groups joined by position."""
    index.files.update(part.files)
    index.checks.extend(part.checks)
    for key, e in part.tensors.items():
        name = param_of(key)
        if key in index.tensors:
            if name is not None and owner.get(name, stage) != stage:
                if index.tensors[key].shape == e.shape and index.tensors[key].dtype == e.dtype:
                    replicas.setdefault(key, []).append((stage, e))  # a tied module's copy: verify --deep
                    continue
                raise FormatError(
                    f"{key} is {e.dtype} {list(e.shape)} on pipeline stage {stage} but "
                    f"{index.tensors[key].dtype} {list(index.tensors[key].shape)} on stage "
                    f"{owner[name]}; the copies of a tied module must agree"
                )
            raise FormatError(f"{key} appears in pipeline stages {owner.get(name or key)} and {stage}")
        if name is not None:
            owner.setdefault(name, stage)
        e.attrs = {**e.attrs, "parallel": {"pp": {"stage": stage, "size": pp}}}
        index.add_tensor(e)
    for key, obj in part.objects.items():
        if key.startswith("optim.param_groups."):
            merge_group_value(index, key, obj, stage)
        elif key.startswith("optim.state."):
            name = state_param(key)
            if key in index.objects and owner.get(name, stage) != stage:
                continue
            index.add_object(obj)
        elif key not in index.objects:  # ds.*, client.*: the stages' copies of one engine's values
            index.add_object(obj)


def param_of(key: str) -> str | None:
    """The parameter a `model.`, `ds_module.` or `optim.state.` key belongs to."""
    for prefix in ("model.", "ds_module."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return state_param(key) if key.startswith("optim.state.") else None


def state_param(key: str) -> str:
    """The parameter of `optim.state.<name>.<key>` (the state key is the last part)."""
    return key[len("optim.state.") :].rpartition(".")[0]


def merge_group_value(index: CheckpointIndex, key: str, obj: ObjectEntry, stage: int) -> None:
    """Param group g of every stage is one group of the full model: `params` lists them all in
    stage order (a tied name once); every other hyperparameter must agree."""
    if key not in index.objects:
        index.add_object(ObjectEntry(key, list(obj.data) if key.endswith(".params") else obj.data, path=obj.path))
        return
    have = index.objects[key]
    if key.endswith(".params"):
        have.data = list(have.data) + [n for n in obj.data if n not in have.data]
    elif have.data != obj.data:
        raise UnsupportedError(
            f"{key} is {quote(repr(obj.data))} on pipeline stage {stage} but "
            f"{quote(repr(have.data))} on stage 0; stages with different hyperparameters "
            f"cannot be joined into one optimizer"
        )


def _stage_of(index: CheckpointIndex, key: str) -> int:
    return index.tensors[key].attrs["parallel"]["pp"]["stage"]
