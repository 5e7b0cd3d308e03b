"""Async saves: the state staged as a CPU copy (training goes on while it is written), and the
background thread that makes the copy and writes it, whose failure the next call on this rank raises.

The copy of a tensor the optimizer owns (a parameter, a moment) is made on that thread, while the
training loop runs its next forward and backward: such a tensor only changes in `optimizer.step()`,
which step_guard.py makes wait until the copy is made. Everything else (buffers such as a norm's
running statistics, which a forward changes; `extra`; `states`) is copied before save() returns.
Each deferred tensor's version counter (which every in-place change moves) is read at the call and
again once its copy is made: a tensor changed in between fails the save instead of writing a torn
mix of two steps.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import UsageError


class StateChangedError(UsageError):
    """A tensor of an async save changed in place before its copy was made."""


@dataclass
class Deferred:
    """A copy made off the training thread: `source` into `target`; `leaf` (the state dict's own
    tensor, a DTensor's outer one) must still be at `version` once it is made."""

    target: torch.Tensor
    source: torch.Tensor
    leaf: torch.Tensor
    version: int
    path: tuple


@dataclass
class Staging:
    """What save() staged: the state dict over CPU buffers, the copies still to make into them,
    and every buffer, in order (the next save copies into them)."""

    state: Any
    deferred: list[Deferred]
    buffers: list[torch.Tensor]
    event: Any = None  # a CUDA event recorded on the caller's stream, when a deferred source is on a GPU
    device: Any = None

    def finish(self) -> Any:
        """Make the deferred copies (on the background thread) and return the staged state dict;
        a StateChangedError when a source changed in place before its copy was made."""
        if self.deferred:
            if self.event is not None:
                _copy_cuda(self.deferred, self.event, self.device)
            else:
                for d in self.deferred:
                    d.target.copy_(d.source)
            self.state = _wrap(self.state)
            changed = [d for d in self.deferred if d.leaf._version != d.version]
            if changed:
                raise StateChangedError(
                    f"the state changed while an async save copied it: {_dotted(changed[0].path)} "
                    f"(and {len(changed) - 1} other tensor(s)) was modified in place after save() "
                    f"returned and before its copy was made; nothing of this step was written. "
                    f"Only optimizer.step() may change the saved tensors while a save is in flight "
                    f"(it waits for the copy); call wait_staged() before changing them otherwise"
                )
        return self.state


class BackgroundSave:
    """At most one save running in the background, and the CPU copies the last one staged: free
    again once it is written, the next save copies into them (same shapes and dtypes) instead of
    allocating, and faulting in, the state's size in fresh memory each time (pinned memory, for a
    GPU's state, is slower yet). `staged` is set whenever no copy is being made."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.staged = threading.Event()
        self.staged.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, name: str, stage: Callable[[], Any], write: Callable[[Any, BaseException | None], None]) -> None:
        """In a daemon thread called `name`: `stage()` (then `staged` is set), then
        `write(staged, stage's failure or None)`; a failure is kept for `raise_error`."""
        self.staged.clear()
        self._thread = threading.Thread(target=self._run, args=(stage, write), name=name, daemon=True)
        self._thread.start()

    def _run(self, stage: Callable[[], Any], write: Callable[[Any, BaseException | None], None]) -> None:
        staged, failure = None, None
        try:
            staged = stage()
        except BaseException as exc:  # every rank hears of it before anything is written
            failure = exc
        finally:
            self.staged.set()
        try:
            write(staged, failure)
        except BaseException as exc:  # raised by the next call on this rank
            self._error = exc

    def wait_staged(self) -> None:
        """Until the save in flight has made its copy (at once when none is)."""
        self.staged.wait()

    def wait(self) -> None:
        """Join the background save (its failure is raised here, or by the next call)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def stage(obj: Any, reuse: list[torch.Tensor] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """A CPU copy of a state dict, made now; and the copies made, in order (see `prepare`)."""
    staging = prepare(obj, set(), reuse)
    return staging.state, staging.buffers


def prepare(obj: Any, owned: set[int], reuse: list[torch.Tensor] | None = None) -> Staging:
    """Stage a state dict over CPU buffers (DTensors stay DTensors over CPU copies of their
    shards; pinned memory when the source is on a GPU), so training can go on while the copy is
    written. A tensor whose storage is in `owned` (step_guard.owned_storages) is copied later, by
    `Staging.finish`; every other one now. The k-th tensor goes into `reuse[k]` (a previous save's
    staging, no longer read) when that has its shape, dtype and memory kind, else into new memory."""
    DTensor = _dtensor_type()
    old = list(reuse or ())
    staging = Staging(state=None, deferred=[], buffers=[])
    cuda_now: list[bool] = []

    def copy_tensor(t: torch.Tensor, leaf: torch.Tensor, path: tuple) -> torch.Tensor:
        t = t.detach()
        k = len(staging.buffers)
        out = _buffer_for(t, old[k] if k < len(old) else None)
        version = _version_of(leaf) if t.numel() and t.untyped_storage().data_ptr() in owned else None
        if version is not None:
            staging.deferred.append(Deferred(out, t, leaf, version, path))
            if t.is_cuda and staging.event is None:
                staging.event, staging.device = torch.cuda.Event(), t.device
                staging.event.record()  # after every kernel queued so far (an optimizer step's)
        elif t.is_cuda:
            cuda_now.append(True)
            out.copy_(t, non_blocking=True)
        else:
            out.copy_(t)
        staging.buffers.append(out)
        return out

    def visit(v: Any, path: tuple) -> Any:
        if isinstance(v, DTensor):
            n = len(staging.deferred)
            shard = Shard(copy_tensor(v.to_local(), v, path), v)
            return shard if len(staging.deferred) > n else shard.dtensor()  # wrapped by finish() once copied
        if isinstance(v, torch.Tensor):
            return copy_tensor(v, v, path)
        if isinstance(v, dict):
            return {k: visit(x, (*path, k)) for k, x in v.items()}
        if isinstance(v, list):
            return [visit(x, (*path, i)) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return tuple(visit(x, (*path, i)) for i, x in enumerate(v))
        return copy.deepcopy(v)

    staging.state = visit(obj, ())
    if cuda_now:
        torch.cuda.synchronize()
    return staging


@dataclass
class Shard:
    """A DTensor's staged local shard, wrapped as a DTensor like `like` (DTensor.from_local costs
    about a millisecond each: for a deferred copy that is paid on the background thread)."""

    local: torch.Tensor
    like: Any

    def dtensor(self) -> Any:
        v = self.like
        return _dtensor_type().from_local(
            self.local, v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride()
        )


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    return DTensor


def _wrap(v: Any) -> Any:
    """The staged tree with every Shard made a DTensor."""
    if isinstance(v, Shard):
        return v.dtensor()
    if isinstance(v, dict):
        return {k: _wrap(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_wrap(x) for x in v)
    return v


def _buffer_for(t: torch.Tensor, prior: torch.Tensor | None) -> torch.Tensor:
    """`prior` when `t` can be copied into it as a new buffer would be laid out (empty() pinned
    for a GPU's tensor, empty_like for a CPU one), else new memory of that layout."""
    pinned = t.is_cuda
    if prior is not None:
        laid_out = prior.is_contiguous() if pinned else prior.stride() == t.stride()
        if laid_out and prior.shape == t.shape and prior.dtype == t.dtype and prior.is_pinned() == pinned:
            return prior
    if pinned:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return torch.empty_like(t)


def _version_of(leaf: torch.Tensor) -> int | None:
    """The version counter of `leaf`; None for a tensor that keeps none (made in inference mode),
    which is then copied at once."""
    try:
        return leaf._version
    except RuntimeError:
        return None


def _copy_cuda(deferred: list[Deferred], event: Any, device: Any) -> None:
    """GPU -> pinned copies on a side stream of this thread, after everything the caller's stream
    had queued at save(); done when this returns."""
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device=device)
    stream.wait_event(event)
    with torch.cuda.stream(stream):
        for d in deferred:
            d.target.copy_(d.source, non_blocking=True)
    stream.synchronize()


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


__all__ = ["BackgroundSave", "Deferred", "Shard", "StateChangedError", "Staging", "prepare", "stage"]
