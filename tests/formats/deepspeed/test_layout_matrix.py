"""DeepSpeed's parallel layouts as one matrix: every parallel fixture family (tp; ep; tp x ep with
experts sliced or whole; pp; pp x ep with one or two MoE layers a stage; pp x tp x dp) rewritten
by `reshard` at the fixture's own sizes gives DeepSpeed's own files back.

The truth is the files DeepSpeed saved (fixtures/generate_ds_*.py, real runs on CPU), unpickled
with DeepSpeed's classes (fragment_address, ZeroStageEnum): the same file names, and every file
equal object for object, tensors bit for bit (module slices, param_shapes, buffer names, flat
partitions, slice mappings, paddings, partition counts, group names, world sizes, AutoTP's
universal_checkpoint_info).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DATA
from helpers.corrupt import run_cli
from helpers.ds_fixtures import assert_same_pickled, needs_deepspeed


def _info(family: str, name: str) -> dict:
    return json.loads((DATA / family / name / "fixture.json").read_text())


def _folders(family: str, keep=lambda name: True) -> list[str]:
    root = DATA / family
    return sorted(p.name for p in root.iterdir() if p.is_dir() and keep(p.name)) if root.is_dir() else []


# family folder -> (its fixtures, the --to that keeps each one's sizes, whether reading DeepSpeed's
# pickles needs deepspeed, the generator to run when the fixtures are missing)
UNIFORM = ("--partition-method", "uniform")
FAMILIES = {
    "tp": (
        "ds_tp",
        _folders("ds_tp"),
        lambda i: (f"tp={i['tp']},dp={i['dp']}",),
        True,
        "generate_ds_tp.py",
    ),
    "ep": (
        "ds_moe",
        _folders("ds_moe", lambda n: n.startswith("moe")),
        lambda i: (f"ep={i['ep_size']},dp={i['world_size']}",),
        True,
        "generate_ds_moe.py",
    ),
    "tp_ep_sliced": (
        "ds_moe_tp",
        _folders("ds_moe_tp", lambda n: "noexptp" not in n),
        lambda i: (f"tp=2,ep=2,dp={i['dp']}",),
        True,
        "generate_ds_moe_tp.py",
    ),
    "tp_ep_whole": (
        "ds_moe_tp",
        ["moetp_noexptp_z2_fp32_tp2_ep2_w4", "moetp_noexptp_z1_bf16_tp2_ep2_w4"],
        lambda i: ("tp=2,ep=2,dp=2",),
        True,
        "generate_ds_moe_tp.py",
    ),
    "pp": (
        "ds_pp",
        ["pp2_dp2_z1_fp32", "pp2_dp2_z1_bf16", "pp2_dp2_z0_bf16", "pp2_dp1_z1_fp32_tiedhead", "pp2_dp2_z1_fp32_mptopo"],
        lambda i: (f"pp={i['pp']},dp={i['dp']}", *UNIFORM),
        True,
        "generate_ds_pp.py",
    ),
    "pp_ep": (
        "ds_pp_moe",
        ["ppmoe_z1_fp32_pp2_ep2_w4", "ppmoe_z1_fp32_pp2_ep2_w4_moe4"],
        lambda i: ("pp=2,ep=2,dp=2",),
        True,
        "generate_ds_pp_moe.py",
    ),
    "pp_tp_dp": (
        "ds_3d",
        _folders("ds_3d"),
        lambda i: (f"tp={i['tp']},pp={i['pp']},dp={i['dp']}", *UNIFORM),
        False,
        "generate_ds_3d.py",
    ),
}


def _same_size_cases() -> list:
    cases = []
    for family, (folder, names, _, needs_ds, generator) in FAMILIES.items():
        if not names:
            reason = f"no {folder} fixtures (run fixtures/{generator})"
            cases.append(pytest.param(family, "", marks=pytest.mark.skip(reason=reason), id=f"{family}/none"))
        for name in names:
            marks = [needs_deepspeed] if needs_ds else []
            if not (DATA / folder / name).is_dir():
                marks.append(pytest.mark.skip(reason=f"fixture {folder}/{name} missing (run fixtures/{generator})"))
            cases.append(pytest.param(family, name, marks=marks, id=f"{family}/{name}"))
    return cases


@pytest.mark.parametrize("family,name", _same_size_cases())
def test_same_sizes_rewrite_is_deepspeeds_own_files(tmp_path, family, name):
    """Sizes unchanged: the same file names, and every file equal to what DeepSpeed saved."""
    folder, _, to, _, _ = FAMILIES[family]
    source = DATA / folder / name
    res = run_cli("reshard", source, tmp_path / "out", "--to", *to(_info(folder, name)))
    assert res.code == 0, res.output
    src = source / "global_step2"
    assert sorted(p.name for p in (tmp_path / "out" / "global_step2").iterdir()) == sorted(
        p.name for p in src.iterdir()
    )
    for f in sorted(src.iterdir()):
        # DeepSpeed's own pickles (fragment_address, ZeroStageEnum): our fixtures and our output
        assert_same_pickled(
            torch.load(f, weights_only=False),
            torch.load(tmp_path / "out" / "global_step2" / f.name, weights_only=False),
            f.name,
        )
