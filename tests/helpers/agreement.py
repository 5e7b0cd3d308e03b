"""What the hostile/test_agreement_* files share: the fixtures they craft files from, the
whole-contract refusal of such a file by consolidate and verify --deep, and the bit-for-bit
comparison of what ckptkit writes from an accepted one with what the framework's loader gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.hostile import Scene, check_refused, run_ckptkit

DATA = Path(__file__).resolve().parents[2] / "fixtures" / "data"
PLAIN = DATA / "plain_state_dict.pt"
FSDP2 = DATA / "fsdp2_w2"
HF = DATA / "trainer" / "ddp" / "checkpoint-2" / "model.safetensors"


def needs(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"fixture {path.name} is missing (run fixtures/ generation)")


def refused_everywhere(src: Path, tmp: Path, *names: str) -> None:
    """consolidate refuses it under the whole contract; verify --deep does not say ok."""
    out = tmp / "out"
    scene = Scene(src, out)
    check_refused(run_ckptkit("consolidate", src, out), *names, scene=scene)
    verify = run_ckptkit("verify", "--deep", src)
    assert verify.code in (1, 2) and "Traceback" not in verify.output, verify.detail()
    for name in names:
        assert name in verify.output, verify.detail()


def consolidated(src: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / "out"
    run = run_ckptkit("consolidate", src, out)
    assert run.code == 0, run.detail()
    verify = run_ckptkit("verify", "--deep", src)
    assert verify.code == 0, verify.detail()
    from safetensors import safe_open

    got: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
        with safe_open(f, "pt") as opened:
            aliases.update(json.loads((opened.metadata() or {}).get("ckptkit.aliases", "{}")))
    for alias, target in aliases.items():  # tied tensors, written once (a name the files do not hold)
        assert alias not in got
        got[alias] = got[target]
    return got


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(truth: dict, got: dict[str, torch.Tensor]) -> None:
    tensors = {k: v for k, v in truth.items() if isinstance(v, torch.Tensor)}
    assert tensors and set(tensors) <= set(got), sorted(set(tensors) - set(got))
    for key, want in tensors.items():
        have = got[key]
        assert (have.dtype, tuple(have.shape)) == (want.dtype, tuple(want.shape)), key
        assert bits(have) == bits(want), f"{key}: ckptkit's values differ from the framework's"
