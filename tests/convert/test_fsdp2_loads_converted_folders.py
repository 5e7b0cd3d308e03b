"""The user's run, at 2 and 3 ranks: convert an HF source --to dcp --world-size W, then a real FSDP2
job's dcp.load + set_model_state_dict, every value equal to what transformers builds from the source.
Two sources: a folder whose tie lives only in config.json (save_pretrained leaves lm_head.weight out:
convert must add it, tests/convert/test_config_ties.py) and a weights-only model.safetensors (convert
must lay it out as FSDP2 does, every rank's file non-empty, tests/convert/test_weights_only_layout.py).
One torchrun job per world size checks both, since starting the job is what costs."""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner

from ckptkit_cli.main import cli
from conftest import ROOT, subprocess_env, torchrun_cmd
from helpers.hf_folders import llama_folder

pytest.importorskip("transformers", reason="the models are written by transformers' save_pretrained")

pytestmark = pytest.mark.slow


def _convert(*args) -> None:
    res = CliRunner().invoke(cli, ["convert", *map(str, args)])
    assert res.exit_code == 0, res.output


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def job(request, tmp_path_factory) -> dict:
    """Both sources converted at the world size, loaded by one FSDP2 job: {name: (dcp folder, verdict)}."""
    world = request.param
    work = tmp_path_factory.mktemp(f"fsdp2_w{world}")
    tied = llama_folder(work / "tied")
    untied = llama_folder(work / "untied", tie=False)
    _convert(tied, work / "tied_dcp", "--to", "dcp", "--world-size", world)
    _convert(untied / "model.safetensors", work / "weights_dcp", "--to", "dcp", "--world-size", world)
    cmd = [*torchrun_cmd(world), str(ROOT / "tests" / "dist" / "hf_fsdp2_load_job.py")]
    for name, model in (("tied", tied), ("weights", untied)):
        cmd += ["--model", str(model), "--ckpt", str(work / f"{name}_dcp"), "--result", str(work / f"{name}.json")]
    run = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    verdicts = {}
    for name in ("tied", "weights"):
        result = work / f"{name}.json"
        assert result.exists(), run.stdout[-3000:] + run.stderr[-3000:]
        verdicts[name] = (work / f"{name}_dcp", json.loads(result.read_text()))
    return {"world": world, **verdicts}


def test_fsdp2_job_loads_the_tied_folder(job):
    _, verdict = job["tied"]
    assert verdict["ok"], verdict
    assert "lm_head.weight" in verdict["keys"] and verdict["compared"] == 21


def test_fsdp2_job_loads_a_weights_only_file(job):
    folder, verdict = job["weights"]
    assert all((folder / f"__{r}_0.distcp").stat().st_size > 0 for r in range(job["world"]))
    assert verdict["ok"], verdict
