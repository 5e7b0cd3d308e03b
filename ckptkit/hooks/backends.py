"""What the Checkpointer saves and restores, by kind of model: torch modules (plain, DDP, FSDP2)
as DCP through `get_state_dict`, loaded back through `ckptkit.load` at any world size (each rank
reads its own shards); DeepSpeed engines with their own `save_checkpoint` (the native ZeRO
layout), loaded with `load_checkpoint` after a distributed `reshard` when the data-parallel size
changed. The folder, its marker and retention are the Checkpointer's; this is what goes in it."""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import torch

from ..errors import CkptkitError, UsageError
from ..runner.distributed import Group
from . import engine_io
from .saved import STATES, check_restorable, has_prefix, rank_key, template
from .states import check_states, refuse_other_keys

ENGINE_STATES = "ckptkit_states"  # the client-state entry holding `states` for DeepSpeed engines


def is_engine(obj: Any) -> bool:
    """A DeepSpeed engine, recognised without importing deepspeed."""
    return all(hasattr(obj, a) for a in ("save_checkpoint", "load_checkpoint", "module", "global_steps"))


def check_model(model: Any) -> None:
    """What save and restore take as `model` (docs/hooks.md): a torch module or a DeepSpeed engine."""
    if not (is_engine(model) or isinstance(model, torch.nn.Module)):
        raise UsageError(
            f"model must be a torch.nn.Module (plain, DDP or FSDP2) or a DeepSpeed engine "
            f"(got {type(model).__name__}); a state dict is saved with ckptkit.save"
        )


def agree_restorable(group: Group, state: dict, dcp: bool) -> None:
    """Collective: every rank checks its own state (states differ by rank); a refusal on any
    rank is raised on all of them, and the Checkpointer stays usable. For DCP two entries that
    flatten to one name are refused too (a DeepSpeed engine pickles its client state whole)."""
    from ..api import agree, flat_leaves
    from ..index.flatten import flatten

    refusal = None
    try:
        if dcp:
            refuse_other_keys(state.get("extra"), "extra")
            refuse_other_keys(state.get(STATES), "states")
        leaves = flat_leaves(state) if dcp else flatten(state, lambda v: isinstance(v, torch.Tensor))
        check_restorable(leaves)
    except UsageError as exc:
        refusal = exc
    agree(group, refusal)


# ---- torch modules, through DCP -------------------------------------------------------------


def torch_state_dict(model: Any, optimizer: Any) -> dict:
    """The model's (and optimizer's) state dict as torch's `get_state_dict` gives it for DCP."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def torch_state(group: Group, step: int, model: Any, optimizer: Any, extra: dict | None, saved_states: dict) -> dict:
    """The DCP state dict of a step, once every rank found each value in it restorable."""
    state = torch_state_dict(model, optimizer)
    state["extra"] = extra or {}
    if saved_states:
        state[STATES] = {rank_key(group.rank): saved_states}
    state["ckptkit"] = {"step": step}
    agree_restorable(group, state, dcp=True)
    state["extra"] = copy.deepcopy(extra) if extra else {}  # the values at the call (async_save)
    return state


def write_torch(state: dict, folder: str, pg: Any) -> None:
    """Every rank writes its shards of `state` into `folder` as DCP (over the process group `pg`)."""
    from ..api import write_dcp

    write_dcp(state, folder, pg)


def restore_torch(path: str, model: Any, optimizer: Any, states: dict[str, Any], rank: int) -> dict:
    """Load the DCP checkpoint at `path` into `model`, `optimizer` and `states` at this world size;
    the `extra` it was saved with."""
    from ..api import load_opened
    from ..formats.registry import open_checkpoint
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    opened = open_checkpoint(path)  # read once: for the templates and for the load
    index = opened.index
    state = torch_state_dict(model, optimizer)
    extra = template(index, ("extra",))
    if extra is not None:
        state["extra"] = extra
    rk = ""
    if states:
        rk = states_rank(index, rank)
        saved = template(index, (STATES, rk)) or {}
        check_states(path, states, saved)
        state[STATES] = {rk: {k: saved[k] for k in states}}
    load_opened(state, opened, path)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for k, obj in states.items():
        obj.load_state_dict(state[STATES][rk][k])
    return state.get("extra") or {}


def states_rank(index: Any, rank: int) -> str:
    """Whose states `rank` loads: its own rank's, or rank 0's for a rank the saving run did not
    have (a larger world size)."""
    own = rank_key(rank)
    return own if has_prefix(index, (STATES, own)) else rank_key(0)


# ---- DeepSpeed engines, in their own layout ------------------------------------------------


def save_engine(engine: Any, folder: str, step: int, extra: dict | None, states: dict) -> None:
    """The engine's `save_checkpoint` into `folder`, `extra` and `states` as its client state."""
    client = dict(extra or {})
    if states:  # DeepSpeed keeps client state as its saving rank gave it
        client[ENGINE_STATES] = states
    engine_io.save(engine, folder, step, client)


def engine_source(directory: str, step: int, path: str, engine: Any, group: Group) -> tuple[str, str | None]:
    """(the folder the engine loads step `step` from, the scratch folder to remove afterwards):
    `path` itself, or when the data-parallel size changed a reshard of it into a scratch folder of
    `directory` (DeepSpeed refuses another size), written by every rank in parallel."""
    from ..formats.registry import open_checkpoint
    from ..context import RunContext
    from ..ops.reshard import reshard

    saved_world = open_checkpoint(path).index.world_size
    world = int(getattr(engine, "dp_world_size", group.world))
    if saved_world == world:
        return path, None
    scratch = os.path.join(directory, f".resume-step_{step:09d}-w{world}")
    if group.is_root and os.path.exists(scratch):
        shutil.rmtree(scratch)
    group.check(None)
    reshard(path, scratch, world, ctx=RunContext(group=group, overwrite=True))
    return scratch, scratch


def load_engine(engine: Any, folder: str, step: int) -> tuple[dict, dict]:
    """The engine's `load_checkpoint` from `folder`: (the user's extra, the saved states)."""
    loaded, client = engine_io.load(engine, folder, step)
    if loaded is None:
        raise CkptkitError(f"{folder}: DeepSpeed's load_checkpoint loaded nothing")
    from ..formats.registry import format_named

    # DeepSpeed hands back every entry it does not know as client state; keep the user's
    own = format_named("deepspeed").capabilities.own_keys
    extra = {k: v for k, v in dict(client or {}).items() if k not in own}
    saved = extra.pop(ENGINE_STATES, None) or {}
    return extra, saved


def release_scratch(scratch: str | None, group: Group) -> None:
    """Remove `engine_source`'s scratch folder once every rank has read it."""
    if scratch is not None:
        group.check(None)  # every rank has read it before rank 0 removes it
        if group.is_root:
            shutil.rmtree(scratch, ignore_errors=True)
