"""ckptkit reads DeepSpeed's own universal checkpoints (ds_to_universal's output, committed under
fixtures/data/ds_universal/) as the job that saved the source ZeRO checkpoint had them: every
fp32 master, Adam moment and step equal, bit for bit, to what DeepSpeed's
safe_get_full_fp32_param / safe_get_full_optimizer_state returned (the source fixture's truth)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DATA, assert_tensor_equal, read_all

UC_DATA = DATA / "ds_universal"
NAMES = sorted(p.name for p in UC_DATA.iterdir() if p.is_dir()) if UC_DATA.exists() else []


def truth_of(name: str) -> dict:
    record = json.loads((UC_DATA / "VERSIONS.json").read_text())
    return torch.load(DATA.parent.parent / record["truth"][name], weights_only=True)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("where", ["root", "tag folder"])
def test_universal_fixture_reads_as_deepspeed_truth(name: str, where: str) -> None:
    path = UC_DATA / name if where == "root" else UC_DATA / name / "global_step2_universal"
    opened, tensors, objects = read_all(path)
    assert opened.index.format == "ds_universal"
    truth = truth_of(name)
    checked = 0
    for key, value in truth.items():
        kind, _, param = key.partition(".")
        target = {
            "fp32": f"model.{param}",
            "exp_avg": f"optim.state.{param}.exp_avg",
            "exp_avg_sq": f"optim.state.{param}.exp_avg_sq",
            "frozen": f"model.{param}",
            "buffer": f"model.{param}",
        }.get(kind)
        if target is not None:
            expected = value.float() if kind == "frozen" and tensors[target].dtype == torch.float32 else value
            assert_tensor_equal(tensors[target], expected, key)
            checked += 1
        elif kind == "step":
            assert int(objects[f"optim.state.{param}.step"]) == int(value), key
            checked += 1
        elif kind == "tied":
            assert_tensor_equal(tensors[f"model.{param}"], truth[f"fp32.{value}"], key)
        elif kind == "client":
            assert objects[f"client.{param}"] == value, key
        elif key in ("global_steps", "skipped_steps", "global_samples"):
            assert objects[f"ds.{key}"] == value, key
    trainable = [k for k in truth if k.startswith("fp32.")]
    assert checked >= 4 * len(trainable)
    groups = [objects[k] for k in sorted(objects) if k.endswith(".params") and k.startswith("optim.param_groups.")]
    assert sorted(n for g in groups for n in g) == sorted(k[len("fp32.") :] for k in trainable)
