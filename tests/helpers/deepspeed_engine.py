"""A stand-in for a DeepSpeed engine, as the Checkpointer uses one: its save_checkpoint lays out a
real ZeRO checkpoint (a fixture's files) the way DeepSpeed does, so no deepspeed is needed."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from conftest import DATA

DS_FIXTURE = DATA / "deepspeed" / "z1_fp32_w2"


class FakeEngine:
    """What the Checkpointer uses of a DeepSpeed engine; save_checkpoint writes a real ZeRO
    checkpoint (a fixture's files) the way DeepSpeed lays it out."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 2)
        self.global_steps = 0
        self.dp_world_size = 2
        self.loaded: list[tuple[str, str]] = []

    def save_checkpoint(self, save_dir, tag=None, client_state=None):
        src_tag = (DS_FIXTURE / "latest").read_text().strip()
        shutil.copytree(DS_FIXTURE / src_tag, Path(save_dir) / tag)
        (Path(save_dir) / "latest").write_text(tag)
        return True

    def load_checkpoint(self, load_dir, tag=None, **kw):
        self.loaded.append((load_dir, tag))
        return load_dir, {"epoch": 7}
