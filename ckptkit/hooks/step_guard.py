"""What keeps an async save's deferred copy safe: `optimizer.step()` waits until the copy of the
save in flight is made (a step pre-hook, registered once per optimizer and Checkpointer), and the
tensors whose copy may wait are exactly those the optimizer owns (its parameters and its state),
which nothing but its step changes in a training loop. A forward and a backward read parameters
and write gradients, which are not saved; a norm's running statistics are buffers, not the
optimizer's, and are copied before save() returns."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .staging import BackgroundSave


def owned_storages(optimizer: Any) -> set[int]:
    """The storages (data pointers) of `optimizer`'s parameters and state tensors (DTensors: their
    local shards); empty for an optimizer without step hooks, whose tensors are then copied at once."""
    if optimizer is None or not callable(getattr(optimizer, "register_step_pre_hook", None)):
        return set()
    owned: set[int] = set()
    for group in getattr(optimizer, "param_groups", ()):
        for p in group.get("params", ()):
            owned.add(_storage(p))
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    owned.add(_storage(v))
    owned.discard(0)  # empty tensors: nothing to copy, and they would all share this pointer
    return owned


def guard(optimizer: Any, background: BackgroundSave, guarded: weakref.WeakSet) -> set[int]:
    """Make `optimizer.step()` wait for `background`'s copy in flight; once per optimizer
    (`guarded` holds those done). The hook holds `background` weakly. Returns the storages whose
    copy may now wait (owned_storages, walked once per save); empty when `optimizer` cannot be
    guarded (none, no step hooks, nothing to copy, not weakly referable): its tensors are then
    copied at the call."""
    owned = owned_storages(optimizer)
    if not owned:
        return set()
    try:
        if optimizer in guarded:
            return owned
        weakref.ref(optimizer)
    except TypeError:
        return set()
    ref = weakref.ref(background)

    def wait_for_copy(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        bg = ref()
        if bg is not None:
            bg.wait_staged()

    optimizer.register_step_pre_hook(wait_for_copy)
    guarded.add(optimizer)
    return owned


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()
