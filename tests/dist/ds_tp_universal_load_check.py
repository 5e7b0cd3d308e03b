"""ds_tp_load_check.py for a universal checkpoint: the fixture's DeepSpeed config gets
``"checkpoint": {"load_universal": true}``, so engine.load_checkpoint(DIR) reads the tag
``DIR/latest_universal`` names, and DeepSpeed's AutoTP layers cut each whole tensor for the new
tp themselves; every parameter, moment and module weight is compared as ds_tp_load_check.py
compares them (same arguments)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "fixtures"))

import generate_ds_tp as gen  # noqa: E402

import ds_tp_load_check as base  # noqa: E402

_config = gen.ds_config


def universal_config(*args, **kwargs) -> dict:
    cfg = _config(*args, **kwargs)
    cfg.setdefault("checkpoint", {})["load_universal"] = True
    return cfg


def check_case(argv: list[str], rank: int, world: int) -> dict:
    """One case of a launch of several (tests/dist/ds_engine_cases.py): ds_tp_load_check's, with the
    generator's config put back afterwards."""
    gen.ds_config = universal_config
    try:
        return base.check_case(argv, rank, world)
    finally:
        gen.ds_config = _config


if __name__ == "__main__":
    gen.ds_config = universal_config
    base.main()
