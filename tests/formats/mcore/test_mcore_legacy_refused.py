"""One rank's file of a legacy Megatron-LM checkpoint (`iter_N/mp_rank_TT/model_optim_rng.pt`,
one file per tensor rank) is never presented as the whole model: the file and its rank folder
are refused in one sentence that names the file, what its args say and what to do (open the
iteration folder, whose ranks are joined: test_mcore_legacy_join.py). (Written from
megatron-core's own module state dicts in Megatron-LM's container: fixtures/make_mcore_fixtures.py.)"""

from __future__ import annotations

import pytest
import torch

from ckptkit.errors import UnsupportedError
from ckptkit.formats.registry import open_checkpoint
from conftest import DATA
from helpers.hostile import Scene, check_refused, run_ckptkit

LEGACY = DATA / "mcore" / "legacy_tp2"
ITER = LEGACY / "iter_0000002"
RANK0 = ITER / "mp_rank_00" / "model_optim_rng.pt"


def test_the_rank_file_holds_half_of_a_tensor_parallel_model():
    """What makes it wrong to read alone: the fused QKV and SwiGLU fc1 are split over the ranks."""
    whole = torch.load(RANK0, weights_only=False)  # (trusted fixture: the module's own state dict)
    assert whole["args"].tensor_model_parallel_size == 2
    truth = torch.load(DATA / "mcore" / "legacy_tp2.rank0.truth.pt", weights_only=True)
    assert truth["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == 32  # 2 x ffn 32 / tp 2


@pytest.mark.parametrize("path", [RANK0, RANK0.parent], ids=["file", "rank folder"])
def test_one_ranks_way_in_is_refused_in_one_sentence(path):
    with pytest.raises(UnsupportedError) as err:
        open_checkpoint(str(path))
    text = str(err.value)
    assert "legacy Megatron-LM" in text or "Megatron-LM checkpoint" in text
    assert "not the whole model" in text or "one rank's part" in text
    assert "give ckptkit the iteration folder" in text


def test_the_rank_file_refusal_names_the_file_and_what_its_args_say():
    with pytest.raises(UnsupportedError) as err:
        open_checkpoint(str(RANK0))
    text = str(err.value)
    assert str(RANK0) in text
    assert "tensor_model_parallel_size=2, pipeline_model_parallel_size=1" in text


@pytest.mark.parametrize("command", [["inspect"], ["consolidate"], ["convert", "--to", "dcp"]])
def test_no_command_writes_half_a_model(tmp_path, command):
    out = tmp_path / "out"
    writes = command != ["inspect"]
    scene = Scene(ITER, out if writes else None)
    run = run_ckptkit(command[0], RANK0, *([out] if writes else []), *command[1:])
    check_refused(run, str(RANK0), "tensor_model_parallel_size=2", scene=scene)
    assert not out.exists()


def test_verify_reports_the_rank_file_as_a_problem():
    run = run_ckptkit("verify", "--deep", RANK0)
    assert run.code == 1 and "Traceback" not in run.output
    assert "1 problem(s) found" in run.stderr and "not the whole model" in run.stderr


def test_telling_an_ordinary_torch_save_file_apart_reads_only_its_pickle_head(monkeypatch):
    """Every torch.save file passes the Megatron check first: it must not parse the archive's
    directory (20k members for 20k tensors) unless the pickle's head names Megatron's args."""
    from ckptkit.formats.mcore import legacy
    from ckptkit.formats.mcore.format import MCORE
    from ckptkit.storage.source import open_source

    def refuse(*args, **kwargs):
        raise AssertionError("the archive was opened")

    monkeypatch.setattr(legacy, "open_archive", refuse)
    assert not MCORE.detect(open_source(str(DATA)), "plain_state_dict.pt")
    assert not MCORE.detect(open_source(str(DATA)), "fsdp1_full_state_dict.pt")
    with pytest.raises(AssertionError, match="the archive was opened"):
        MCORE.detect(open_source(str(RANK0.parent)), RANK0.name)
