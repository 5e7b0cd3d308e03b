"""A DeepSpeed engine's own save_checkpoint and load_checkpoint, their errors unwrapped.

torch.save's zip writer turns a failed write (EFBIG, ENOSPC, EIO) into a RuntimeError that keeps
the OSError only as its context, and DeepSpeed passes it on: here the OSError is raised instead,
so the Checkpointer's output words it in one sentence and commits nothing (framework_errors.py).
"""

from __future__ import annotations

from typing import Any

from ..errors import CkptkitError
from ..framework_errors import framework_cause


def save(engine: Any, folder: str, step: int, client: dict) -> None:
    """engine.save_checkpoint of `step` into `folder` (the output's temporary)."""
    from ..formats.registry import step_folder_name

    try:
        engine.save_checkpoint(folder, tag=step_folder_name("deepspeed", step), client_state=client)
    except Exception as exc:
        cause = framework_cause(exc)
        if cause is exc:
            raise
        raise cause from None


def load(engine: Any, path: str, step: int) -> tuple[Any, Any]:
    """engine.load_checkpoint of `step`, optimizer and scheduler included; a system error it met
    is one sentence naming the checkpoint."""
    from ..formats.registry import step_folder_name

    try:
        return engine.load_checkpoint(
            path, tag=step_folder_name("deepspeed", step), load_optimizer_states=True, load_lr_scheduler_states=True
        )
    except Exception as exc:
        cause = framework_cause(exc)
        if isinstance(cause, OSError):
            raise CkptkitError(
                f"{path}: {cause.strerror or cause} while DeepSpeed's load_checkpoint read step {step}"
            ) from None
        if cause is exc:
            raise
        raise cause from None
