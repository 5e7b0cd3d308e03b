"""The differential oracle: structural mutants of real fixtures, each read by ckptkit and by the
framework's own loader from the same bytes; what ckptkit accepts must be what the framework reads.

Per mutant (tests/helpers/oracle_verdict.py): ckptkit refuses (a CkptkitError, or `verify --deep`
lists a problem): fine. ckptkit accepts and the framework refuses: a finding, unless
docs/reliability.md lists the difference on purpose. Both accept: the same tensor names, every
tensor bit-equal. Any other exception from ckptkit is a finding too. Every finding of a run is
listed at once. The operators per format are in tests/helpers/oracle_{torchsave,zip,pickle,
safetensors,dcp,deepspeed}.py; `--examples N` mutants per operator (default: the CI run's, about a
minute on two cores), `--oracle-seed S` for another draw. Findings filed and being fixed are
expected strictly (tests/helpers/oracle_known.py): the format's test is then an xfail, and fails
when an entry no longer fires at the CI seed, so a fixed entry gets deleted.
"""

from __future__ import annotations

import random
import traceback
from pathlib import Path

import pytest
import torch

from conftest import DATA
from helpers import oracle_dcp, oracle_deepspeed, oracle_safetensors, oracle_torchsave
from helpers.oracle_known import KNOWN
from helpers.oracle_verdict import (
    Mutant,
    ckptkit_consolidated,
    ckptkit_read,
    compare,
    framework_read,
    intended_differences,
    upcast_to_ours,
)

# mutants per operator in the CI run (DCP's framework load is ~10x slower than the others')
DEFAULT_EXAMPLES = {"torch_save": 24, "safetensors": 24, "dcp": 6, "deepspeed": 6}
DS_FIXTURES = ["z2_fp32_w2", "z3_fp32_w2", "z3_bf16_w2"]


def _mixed_dtypes(out: Path) -> Path:
    """A torch.save file holding float32, float16, bfloat16, float64, int8 and bool tensors."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(4, 6, generator=gen)
    state = {
        "f32": base,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "f64": base.double()[:2],
        "i8": (base * 10).to(torch.int8),
        "flag": base > 0,
        "view": base.half()[1:, 2:],
    }
    torch.save(state, out)
    return out


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, list[Path]]:
    """The files each format's operators mutate: fixtures/data, and files the frameworks write here."""
    from safetensors.torch import save_file

    from ckptkit.ops.consolidate import consolidate

    work = tmp_path_factory.mktemp("oracle_fixtures")
    plain = torch.load(DATA / "plain_state_dict.pt", weights_only=True)
    save_file(
        {k: v.contiguous().clone() for k, v in plain.items()},
        str(work / "library.safetensors"),
        metadata={"format": "pt"},
    )
    consolidate(str(DATA / "plain_state_dict.pt"), str(work / "consolidated.safetensors"))  # with ckptkit.aliases
    return {
        "torch_save": [
            DATA / "plain_state_dict.pt",
            DATA / "fsdp1_full_state_dict.pt",
            _mixed_dtypes(work / "mixed_dtypes.pt"),
        ],
        "safetensors": [work / "library.safetensors", work / "consolidated.safetensors"],
        "dcp": [DATA / "fsdp2_w2", DATA / "fsdp2_w3"],
        "deepspeed": [DATA / "deepspeed" / name for name in DS_FIXTURES],
    }


MODULES = {
    "torch_save": (oracle_torchsave, ".pt"),
    "safetensors": (oracle_safetensors, ".safetensors"),
    "dcp": (oracle_dcp, ""),
    "deepspeed": (oracle_deepspeed, ""),
}


def judge(mutant: Mutant, module, intended, scratch: Path) -> tuple[str | None, bool]:
    """(the finding for one mutant or None, whether ckptkit accepted it). A ZeRO checkpoint is
    judged by what consolidate writes (zero_to_fp32's counterpart), every other format by the
    tensors ckptkit's index reads."""
    try:
        ours = (
            ckptkit_consolidated(mutant.path, scratch / "out.safetensors")
            if mutant.fmt == "deepspeed"
            else ckptkit_read(mutant.path)
        )
    except Exception as exc:  # noqa: BLE001 - anything but a CkptkitError breaks the contract
        where = traceback.format_exc(limit=-1)[-300:]
        return f"ckptkit raised {type(exc).__name__}, not a CkptkitError: {exc} ({where})", True
    if ours.refusal is not None:
        return None, False
    adjust = upcast_to_ours if mutant.fmt == "deepspeed" and "zero-fp32-upcast" in intended else None
    return compare(mutant, ours, framework_read(module.framework_load, mutant.path), intended, adjust), True


@pytest.mark.parametrize("fmt", list(MODULES))
def test_ckptkit_reads_what_the_framework_reads(fmt, fixtures, tmp_path, request):
    if fmt == "deepspeed":
        pytest.importorskip("deepspeed", reason="ZeRO mutants are compared with DeepSpeed's own zero_to_fp32")
    module, suffix = MODULES[fmt]
    examples = request.config.getoption("--examples") or DEFAULT_EXAMPLES[fmt]
    seed = request.config.getoption("--oracle-seed")
    intended = intended_differences()
    findings, made, accepted = [], dict.fromkeys(module.OPERATORS, 0), 0
    for n in range(examples):
        for name in module.OPERATORS:
            rng = random.Random(f"{seed}:{fmt}:{name}:{n}")
            fixture = rng.choice(fixtures[fmt])
            mutant = module.mutate(name, rng, fixture, tmp_path / f"{name}.{n}{suffix}")
            if mutant is None:
                continue
            scratch = tmp_path / f"{name}.{n}.out"
            scratch.mkdir()
            verdict, taken = judge(mutant, module, intended, scratch)
            made[name] += 1
            accepted += taken
            if verdict is not None:
                findings.append((mutant, verdict))
    idle = [name for name, count in made.items() if not count]
    assert not idle or examples < DEFAULT_EXAMPLES[fmt], f"operators that made no mutant (they test nothing): {idle}"
    assert accepted, "ckptkit accepted no mutant: nothing was compared with the framework"
    known, unknown = [], []
    for mutant, verdict in findings:
        hit = next((k for k in KNOWN if k.matches(mutant, verdict)), None)
        (known if hit else unknown).append((hit, f"[{mutant.operator}] {mutant.description} => {verdict}"))
    assert not unknown, (
        f"{len(unknown)} mutants ckptkit accepts read otherwise than the framework "
        f"(seed {seed}, {examples} per operator):\n" + "\n".join(line for _, line in unknown)
    )
    mine = [k for k in KNOWN if k.fmt == fmt]
    if examples >= DEFAULT_EXAMPLES[fmt] and seed == 0:
        stale = [k.what for k in mine if not any(hit is k for hit, _ in known)]
        assert not stale, f"KNOWN entries no longer found (their fixes landed: delete them): {stale}"
    if known:
        pytest.xfail(f"{len(known)} mutants hit KNOWN findings: " + "; ".join(sorted({h.what for h, _ in known})))
