"""`Checkpointer`: save, retain and resume a training run, also after the cluster changed size.

    ckpt = Checkpointer("/ckpts/run1", keep=3, async_save=False)
    step = ckpt.restore(model, optimizer)          # None on a fresh start
    ...
    ckpt.save(step, model, optimizer, extra={"epoch": epoch})   # every rank calls it

Each checkpoint is a folder `step_<N>` committed atomically (written as a hidden temporary
sibling, renamed by rank 0 after every rank succeeded), so a folder that exists is complete and
anything a crash leaves behind is a hidden temporary that restore skips and sweeps. Torch
modules (plain, DDP, FSDP2) are saved as DCP with `get_state_dict`; DeepSpeed engines with their
own `save_checkpoint` (the native ZeRO layout). Restore picks the newest complete checkpoint and
loads it at the current world size whatever size wrote it: torch modules through `ckptkit.load`
(each rank reads its own shards), DeepSpeed engines through a distributed `reshard` first when
the data-parallel size changed.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import threading
from typing import Any

import torch

from ..errors import CkptkitError, UsageError
from ..runner.distributed import Group, group_of
from ..storage.output import OutputDir, lock_is_stale

STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_MARK = ".ckptkit-tmp-"
LOCK_MARK = ".ckptkit-lock"


def _is_engine(obj: Any) -> bool:
    """A DeepSpeed engine, recognised without importing deepspeed."""
    return all(hasattr(obj, a) for a in ("save_checkpoint", "load_checkpoint", "module", "global_steps"))


class Checkpointer:
    """Saves into `directory/step_<N>`, keeps the newest `keep`, restores the newest complete one."""

    def __init__(self, directory: str, keep: int = 3, async_save: bool = False) -> None:
        if keep < 1:
            raise UsageError(f"keep must be at least 1 (got {keep})")
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.async_save = async_save
        self.extra: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._bg_pg: Any = None
        self._group = group_of()
        if self._group.is_root:
            os.makedirs(self.directory, exist_ok=True)
        if async_save and self._group.distributed:
            import torch.distributed as dist

            # background saves talk over their own group, never interleaving with training's
            self._bg_pg = dist.new_group(backend="gloo")

    # ---- listing -------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(m.group(1)) for n in os.listdir(self.directory)
                      if (m := STEP_DIR.match(n)) and os.path.isdir(os.path.join(self.directory, n)))

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:09d}")

    # ---- saving --------------------------------------------------------------------------

    def save(self, step: int, model: Any, optimizer: Any = None, extra: dict | None = None) -> None:
        """Collective. Save `step`; with async_save return once a CPU copy is staged."""
        self._raise_background()
        self.wait()
        if not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative int (got {step!r})")
        if _is_engine(model):
            if optimizer is not None and extra is None and isinstance(optimizer, dict):
                extra, optimizer = optimizer, None
            self._save_engine(step, model, extra)
            return
        state = self._state_dict(model, optimizer)
        state["extra"] = copy.deepcopy(extra) if extra else {}
        state["ckptkit"] = {"step": step}
        if not self.async_save:
            self._write(step, state, self._group, None)
            return
        staged = _stage(state)
        group = group_of(self._bg_pg) if self._bg_pg is not None else self._group
        self._thread = threading.Thread(target=self._background, args=(step, staged, group),
                                        name=f"ckptkit-save-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Join a background save (its failure is raised here, or by the next call)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_background()

    def _raise_background(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _background(self, step: int, state: dict, group: Group) -> None:
        try:
            self._write(step, state, group, self._bg_pg)
        except BaseException as exc:  # raised by the next call on this rank
            self._error = exc

    def _write(self, step: int, state: dict, group: Group, pg: Any) -> None:
        from ..api import save

        save(state, self.path(step), pg=pg, overwrite=True)  # `group` is group_of(pg)
        self._retain(group)

    def _save_engine(self, step: int, engine: Any, extra: dict | None) -> None:
        with OutputDir(self.path(step), overwrite=True, group=self._group) as out:
            engine.save_checkpoint(out.tmp, tag=f"global_step{step}", client_state=dict(extra or {}))
        self._retain(self._group)

    def _retain(self, group: Group) -> None:
        if not group.is_root:
            return
        for old in self.steps()[:-self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)

    @staticmethod
    def _state_dict(model: Any, optimizer: Any) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optim": osd}

    # ---- restoring -----------------------------------------------------------------------

    def restore(self, model: Any, optimizer: Any = None) -> int | None:
        """Collective. Load the newest complete checkpoint at the current world size; its step,
        or None when there is none. `extra` then holds what save() was given."""
        self.wait()
        self._sweep()
        steps = self.steps()
        if not steps:
            self.extra = None
            return None
        step = steps[-1]
        if _is_engine(model):
            self._restore_engine(step, model)
            return step
        from ..api import load
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self._state_dict(model, optimizer)
        load(state, self.path(step))
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.extra = _extras(self.path(step))
        return step

    def _restore_engine(self, step: int, engine: Any) -> None:
        from ..formats.registry import open_checkpoint
        from ..ops.options import RunOptions
        from ..ops.reshard import reshard

        path = self.path(step)
        saved_world = open_checkpoint(path).index.world_size
        world = int(getattr(engine, "dp_world_size", self._group.world))
        load_from, scratch = path, None
        if saved_world != world:  # DeepSpeed refuses another size: reshard on the fly, in parallel
            scratch = os.path.join(self.directory, f".resume-step_{step:09d}-w{world}")
            if self._group.is_root and os.path.exists(scratch):
                shutil.rmtree(scratch)
            self._group.check(None)
            reshard(path, scratch, world, options=RunOptions(group=self._group, overwrite=True))
            load_from = scratch
        try:
            loaded, client = engine.load_checkpoint(load_from, tag=f"global_step{step}",
                                                    load_optimizer_states=True, load_lr_scheduler_states=True)
            if loaded is None:
                raise CkptkitError(f"{load_from}: DeepSpeed's load_checkpoint loaded nothing")
            from ..formats.deepspeed.reader import DS_KEYS, STRUCTURAL_KEYS

            # DeepSpeed hands back every entry it does not know as client state; keep the user's
            self.extra = {k: v for k, v in dict(client or {}).items()
                          if k not in DS_KEYS and k not in STRUCTURAL_KEYS}
        finally:
            if scratch is not None:
                self._group.check(None)  # every rank has read it before rank 0 removes it
                if self._group.is_root:
                    shutil.rmtree(scratch, ignore_errors=True)

    def _sweep(self) -> None:
        """Rank 0 removes what killed saves left behind: locks whose process is gone (a kill can
        land between taking the lock and creating the temporary folder), then temporaries whose
        lock is not held."""
        if self._group.is_root and os.path.isdir(self.directory):
            names = [n for n in os.listdir(self.directory) if n.startswith(".step_")]
            for name in names:
                lock = os.path.join(self.directory, name)
                if name.endswith(LOCK_MARK) and lock_is_stale(lock):
                    try:
                        os.unlink(lock)
                    except FileNotFoundError:
                        pass
            for name in names:
                if TMP_MARK in name:
                    target = name[1:name.index(TMP_MARK)]
                    if not os.path.exists(os.path.join(self.directory, f".{target}{LOCK_MARK}")):
                        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        self._group.check(None)


def _extras(path: str) -> dict:
    from ..formats.registry import open_checkpoint
    from ..index.flatten import unflatten

    index = open_checkpoint(path).index
    items = [(tuple(o.path[1:]), o.value) for o in index.objects.values() if o.path and o.path[0] == "extra"]
    return unflatten(items) if items else {}


def _stage(obj: Any) -> Any:
    """A CPU copy of a state dict (DTensors stay DTensors over CPU copies of their shards; pinned
    memory when the source is on a GPU), so training can go on while the copy is written."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    cuda_seen = []

    def copy_tensor(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.is_cuda:
            cuda_seen.append(True)
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)
        return t.clone()

    def visit(v: Any) -> Any:
        if isinstance(v, DTensor):
            return DTensor.from_local(copy_tensor(v.to_local()), v.device_mesh, v.placements, run_check=False,
                                      shape=v.shape, stride=v.stride())
        if isinstance(v, torch.Tensor):
            return copy_tensor(v)
        if isinstance(v, dict):
            return {k: visit(x) for k, x in v.items()}
        if isinstance(v, list):
            return [visit(x) for x in v]
        if isinstance(v, tuple):
            return tuple(visit(x) for x in v)
        return copy.deepcopy(v)

    staged = visit(obj)
    if cuda_seen:
        torch.cuda.synchronize()
    return staged
