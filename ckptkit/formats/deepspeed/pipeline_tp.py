"""Index a 3-D DeepSpeed checkpoint: a PipelineModule whose layers are tensor-parallel
(Megatron-DeepSpeed's PipeModelDataParallelTopology with num_mp > 1).

What DeepSpeed writes (tp T, pp P, dp D): `layer_file(XX, YY)` per (layer, tp rank
YY), `model_file(SS)` and `optim_file(D, mp=SS)` with
SS = stage * T + tp rank (the grid's model-parallel rank). So tp rank t's files are an ordinary
pipeline checkpoint (pipeline.read_pipeline reads it; pipeline.py calls `join` here), and the T pipelines are joined
tensor by
tensor as model_parallel.py joins T ZeRO checkpoints: each parameter's split from what the
checkpoint records, then the split rules (--tp-rules, then the built-in ones). Each tensor gets
attrs["parallel"] = {"pp": {stage, size}, "tp": {dim, size}}. pipeline_tp_writer.py lays one out
at new sizes.
"""

from __future__ import annotations

from ...convert.tp_rules import TpRules, TpSplit, chosen_rules_file, load_rules, recorded_rules
from ...errors import FormatError
from ...index.types import CheckpointIndex, TensorEntry
from ...storage.source import Source
from . import model_parallel as mp
from .native import DeepSpeedNative, layout_read
from .tp_geometry import param_name


def join(
    source: Source, subs: dict[int, CheckpointIndex], label: str, tp_rules: TpRules | None = None
) -> CheckpointIndex:
    """The full model's index of a pipeline whose stages are tp ranks wide, from tp rank t's
    pipeline index subs[t] (pipeline.read_pipeline)."""
    tp = len(subs)
    pp = int(subs[0].native.pp)
    first = subs[0]
    rules = tp_rules if tp_rules is not None else load_rules(chosen_rules_file())
    uc = first.objects.get("ds.universal_checkpoint_info")
    recorded = recorded_rules(uc.data if uc is not None else None, label)
    chain = recorded.then(rules) if recorded is not None else rules
    dp = int(first.native.dp)
    index = CheckpointIndex(format=first.format, root=first.root, world_size=pp * tp * dp)
    for sub in subs.values():
        index.files.update(sub.files)
        index.checks.extend(sub.checks)
    splits: dict[str, TpSplit] = {}
    replicas: dict[str, list[tuple[int, TensorEntry]]] = {}
    for key, e0 in first.tensors.items():
        entries = [_same_entry(subs, t, key, e0, label) for t in range(tp)]
        full = mp.full_entry(entries, param_name(e0), first, chain, splits, tp, label)
        full.attrs = {**full.attrs, "parallel": {**e0.attrs.get("parallel", {}), **full.attrs["parallel"]}}
        index.add_tensor(full)
        if full.attrs["parallel"]["tp"]["dim"] is None:
            replicas[key] = list(enumerate(entries))[1:]
    for obj in first.objects.values():
        index.add_object(obj)
    index.step = first.step
    index.metadata.update({k: v for k, v in first.metadata.items() if k not in ("deepspeed", "parallel")})
    ds = dict(first.metadata.get("deepspeed", {}))
    index.metadata["deepspeed"] = {
        **ds,
        "world_size": pp * tp * dp,
        "mp_world_size": pp * tp,
        "pipeline": {**ds.get("pipeline", {}), "tensor_parallel": tp},
    }
    index.metadata["parallel"] = {"pp": pp, "tp": tp, "dp": dp}
    cells = {(s, t): z for t, sub in subs.items() for (s, _), z in sub.native.cells.items()}
    lanes = {t: sub.native.lanes[0] for t, sub in subs.items()}
    index.native = DeepSpeedNative(
        layout=layout_read(index, cells, lanes), cells=cells, lanes=lanes, splits=splits, tp_copies=replicas
    )
    return index


def _same_entry(subs: dict[int, CheckpointIndex], t: int, key: str, e0: TensorEntry, label: str) -> TensorEntry:
    entry = subs[t].tensors.get(key)
    if entry is None:
        raise FormatError(f"{label}: tensor-parallel rank {t}'s pipeline has no {key} (rank 0's has it)")
    if entry.dtype != e0.dtype or len(entry.shape) != len(e0.shape):
        raise FormatError(
            f"{label}: {key} is {entry.dtype} {list(entry.shape)} on tensor-parallel rank {t}, "
            f"{e0.dtype} {list(e0.shape)} on rank 0"
        )
    if e0.attrs.get("parallel", {}).get("pp") != entry.attrs.get("parallel", {}).get("pp"):
        raise FormatError(
            f"{label}: {key} is on pipeline stage {entry.attrs['parallel']['pp']['stage']} for "
            f"tensor-parallel rank {t} but stage {e0.attrs['parallel']['pp']['stage']} for rank 0"
        )
    return entry
