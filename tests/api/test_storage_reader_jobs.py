"""ckptkit.StorageReader in real 4-process jobs (gloo, CPU): torch's plain dcp.load + set_state_dict
fill FSDP2 + TP models on a 2 x 2 mesh, and their optimizers, from a DeepSpeed ZeRO-3 checkpoint, a
DeepSpeed ZeRO-2 AutoTP checkpoint and a Hugging Face safetensors folder, every value equal to the
source's truth (tests/dist/storage_reader_check.py), and each model trains a step after; a key the
checkpoint lacks is ckptkit's sentence on every rank."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import DATA, ROOT, subprocess_env, torchrun_cmd
from helpers.ds_fixtures import DS_DATA


def _hf_folder(where) -> None:
    """The fixtures' Llama written by transformers' save_pretrained, in several shards."""
    code = (
        "import sys, torch; sys.path.insert(0, 'fixtures'); import generate_ds_tp as gt; "
        "from transformers import LlamaConfig, LlamaForCausalLM; torch.manual_seed(77); "
        f"LlamaForCausalLM(LlamaConfig(**gt.LLAMA)).save_pretrained({str(where)!r}, max_shard_size='8KB')"
    )
    subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), check=True, capture_output=True, timeout=120
    )
    assert len(list(where.glob("*.safetensors"))) > 1 and (where / "model.safetensors.index.json").exists()


@pytest.mark.slow
def test_dcp_load_through_the_reader_fills_fsdp2_tp_models_from_zero_autotp_and_hf(tmp_path):
    _hf_folder(tmp_path / "hf")
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(4) + [
        str(ROOT / "tests" / "dist" / "storage_reader_check.py"),
        "--zero3",
        str(DS_DATA / "z3_bf16_w2"),
        "--zero3-truth",
        str(DS_DATA / "z3_bf16_w2.truth.pt"),
        "--tp",
        str(DATA / "ds_tp" / "autotp_z2_fp32"),
        "--tp-truth",
        str(DATA / "ds_tp" / "autotp_z2_fp32.truth.pt"),
        "--hf",
        str(tmp_path / "hf"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result.read_text())
    assert doc["ok"], doc
    assert doc["world_size"] == 4
    # every tensor of each source: DSToyModel 14 model + 27 state + 4 group values, Llama 12 + 36
    assert (doc["zero3"]["compared"], doc["tp"]["compared"], doc["hf"]["compared"]) == (45, 48, 12)
    for part in ("zero3", "tp", "hf"):
        assert not doc[part]["mismatches"] and doc[part]["trained_step"], (part, doc[part])
    (message,) = doc["refusal"]["messages"]  # one sentence, the same on all 4 ranks
    assert message.startswith(str(DS_DATA / "z3_bf16_w2") + ": has no model.not_there"), message
