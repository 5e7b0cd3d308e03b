"""Write a DeepSpeed universal checkpoint, one parameter at a time.

The files are the ones DeepSpeed's `load_universal` reads (deepspeed/runtime/engine.py
`load_checkpoint`, base_optimizer.py `load_hp_checkpoint_state_from_checkpoint_dir`,
checkpoint/universal_checkpoint.py `load_hp_checkpoint_state`; ZeRO 3: stage3.py
`load_hp_checkpoint_state_from_checkpoint_dir_stage3`), laid out as ds_to_universal lays them:

    latest_universal                          the tag
    <tag>/mp_rank_00_model_states.pt          read for global_steps, skipped_steps, dp/mp world
                                              sizes, lr_scheduler and the client state (ZeRO 1/2)
    <tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, under the name ZeRO 3 looks for
    <tag>/zero/optimizer_state.pt             ds_version and param_groups (ZeRO 1/2, bf16);
                                              optimizer_state_dict.{state[0].step, param_groups} (ZeRO 3)
    <tag>/zero/<param>/fp32.pt, exp_avg.pt... {"param": tensor}: the whole tensor, any dp/tp cuts it
    <tag>/zero/<param>/step.pt                the optimizer step as it was kept (an int for DeepSpeed's Adam)

Each state file is its own small torch.save archive, streamed by the torch.save archive writer:
memory holds one parameter's one state at a time (within the run's slab), never the model. The
whole folder is written inside the operation's output, so it appears complete or not at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import FormatError, name_of
from ...index.types import TensorEntry
from ..protocols import UniversalTarget
from ..torch_save.archive_writer import LazyTensor, write_archive
from ..torch_save.writer import write_torch_save
from .layout import LATEST_UNIVERSAL, OPTIMIZER_STATE, PARAM, STEP, ZERO, join

if TYPE_CHECKING:
    from ...context import RunContext
    from ...storage.commit import Output

# the engine globs <tag>/mp_rank_*_model_states.pt at ZeRO 1/2 and <tag>/zero_pp_rank_0_mp_rank_*
# at ZeRO 3: both are written, so the folder loads at any stage
MODEL_STATES_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def write_universal(target: UniversalTarget, out: "Output", ctx: "RunContext") -> list[str]:
    """Every file of the universal checkpoint of `target` in `out`; their names."""
    _check_names(target)
    files = []
    for name, states in target.params.items():
        for key, value in states.items():
            rel = join(target.tag, ZERO, name, f"{key}.pt")
            structure = value if key == STEP else {PARAM: _lazy(value, rel)}
            write_archive(out, rel, structure, target.fetcher, slab_bytes=ctx.slab_bytes, progress=ctx.progress)
            files.append(rel)
    rel = join(target.tag, ZERO, OPTIMIZER_STATE)
    write_archive(out, rel, target.optimizer_state, target.fetcher, slab_bytes=ctx.slab_bytes)
    files.append(rel)
    for name in MODEL_STATES_FILES:
        rel = join(target.tag, name)
        write_torch_save(out, rel, target.model_states, target.fetcher, ctx=ctx)
        files.append(rel)
    out.write_bytes(LATEST_UNIVERSAL, target.tag.encode())
    files.append(LATEST_UNIVERSAL)
    return files


def _lazy(value: Any, rel: str) -> LazyTensor:
    if not isinstance(value, TensorEntry):
        raise FormatError(f"{rel}: expected a tensor for this state, got {type(value).__name__}")
    return LazyTensor(value)


def _check_names(target: UniversalTarget) -> None:
    """A parameter's name is a folder name: one that would leave zero/ (or is empty) is refused."""
    for name in target.params:
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise FormatError(
                f"parameter {name_of(name)}: its name cannot be a folder of a universal checkpoint "
                f"(zero/<name>/ holds its states)"
            )
