"""Async saves: the state staged as a CPU copy (training goes on while it is written), and the
background thread that writes it, whose failure the next call on this rank raises."""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import torch


class BackgroundSave:
    """At most one save running in the background, and the CPU copies the last one staged: free
    again once it is written, the next save copies into them (same shapes and dtypes) instead of
    allocating, and faulting in, the state's size in fresh memory each time (pinned memory, for a
    GPU's state, is slower yet)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, name: str, write: Callable[..., None], *args: Any) -> None:
        """Run `write(*args)` in a daemon thread called `name`; its failure is kept for `raise_error`."""
        self._thread = threading.Thread(target=self._run, args=(write, *args), name=name, daemon=True)
        self._thread.start()

    def _run(self, write: Callable[..., None], *args: Any) -> None:
        try:
            write(*args)
        except BaseException as exc:  # raised by the next call on this rank
            self._error = exc

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
    """A CPU copy of a state dict (DTensors stay DTensors over CPU copies of their shards; pinned
    memory when the source is on a GPU), so training can go on while the copy is written; and the
    copies made, in order. The k-th tensor is copied into `reuse[k]` (a previous save's staging,
    no longer read) when that has its shape, dtype and memory kind, else into new memory."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    cuda_seen = []
    old = list(reuse or ())
    made: list[torch.Tensor] = []

    def copy_tensor(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        k = len(made)
        prior = old[k] if k < len(old) else None
        pinned = t.is_cuda
        laid_out = prior is not None and (prior.is_contiguous() if pinned else prior.stride() == t.stride())
        if prior is not None and not (
            laid_out and prior.shape == t.shape and prior.dtype == t.dtype and prior.is_pinned() == pinned
        ):
            prior = None  # (laid out as the new memory would be: empty() for a GPU's, a clone of `t`)
        if t.is_cuda:
            cuda_seen.append(True)
            out = prior if prior is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            made.append(out.copy_(t, non_blocking=True))
        else:
            made.append(prior.copy_(t) if prior is not None else t.clone())
        return made[-1]

    def visit(v: Any) -> Any:
        if isinstance(v, DTensor):
            return DTensor.from_local(
                copy_tensor(v.to_local()),
                v.device_mesh,
                v.placements,
                run_check=False,
                shape=v.shape,
                stride=v.stride(),
            )
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
    return staged, made
