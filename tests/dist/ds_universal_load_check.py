"""ds_load_check.py for a universal checkpoint: DeepSpeed loads DIR with
``"checkpoint": {"load_universal": true}`` (added to the fixture's config) and every value it
restores is compared bit for bit with the truth.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node M \
        tests/dist/ds_universal_load_check.py --ckpt DIR --fixture NAME --truth TRUTH.pt \
        --result OUT.json --tag TAG

What DeepSpeed's universal load restores is what is compared: the fp32 masters, Adam's moments
and steps, the low-precision copies of the trainable parameters, the param groups' lr, the
counters and the client state. It does not load the module state dict
(engine._load_checkpoint skips load_module_state_dict under load_universal), so frozen
parameters and buffers stay as the model was built: those truth keys (``frozen.*``,
``buffer.*``, the frozen parameters' ``module.*``) are left out here, and said so in the result.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ds_load_check as base  # noqa: E402

NOT_RESTORED = ("frozen.", "buffer.", "module.frozen.")
_compare = base.compare


def compare(got: dict, truth: dict) -> tuple[int, list[str]]:
    """base.compare over what a universal load restores (module docstring)."""
    keep = {k: v for k, v in truth.items() if not k.startswith(NOT_RESTORED)}
    return _compare({k: v for k, v in got.items() if not k.startswith(NOT_RESTORED)}, keep)


REQUIRED_PREFIXES = tuple(p for p in base.REQUIRED_PREFIXES if p not in NOT_RESTORED)


def universal_config_file(args) -> Path:
    """The fixture's config with load_universal set (a temporary file)."""
    cfg = json.loads(base._find_config(args).read_text())
    cfg.setdefault("checkpoint", {})["load_universal"] = True
    path = Path(tempfile.mkdtemp()) / "ds_config.json"
    path.write_text(json.dumps(cfg))
    return path


def check_case(argv: list[str], rank: int, world: int) -> dict:
    """One case of a launch of several (tests/dist/ds_engine_cases.py): ds_load_check's, with what
    this script changes in it put back afterwards."""
    config = universal_config_file(base.parse_args(argv))
    kept = base.compare, base.REQUIRED_PREFIXES
    base.compare, base.REQUIRED_PREFIXES = compare, REQUIRED_PREFIXES
    try:
        return base.check_case([*argv, "--ds-config", str(config)], rank, world)
    finally:
        base.compare, base.REQUIRED_PREFIXES = kept


if __name__ == "__main__":
    base.compare = compare
    base.REQUIRED_PREFIXES = REQUIRED_PREFIXES
    sys.argv += ["--ds-config", str(universal_config_file(base.parse_args()))]
    base.main()
