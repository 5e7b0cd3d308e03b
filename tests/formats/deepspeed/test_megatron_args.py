"""Megatron-DeepSpeed checkpoints: every model-states file holds the job's parsed command line.

Megatron-DeepSpeed passes `args` (an argparse.Namespace holding Megatron's enums and torch
dtypes), `checkpoint_version` and `iteration` as client state to DeepSpeed's save_checkpoint,
so they land in each `mp_rank_XX_model_states.pt`. Before, the restricted unpickler refused
argparse.Namespace and no such checkpoint could be read at any parallelism. Here a real
DeepSpeed tensor-parallel fixture gets those values added exactly as Megatron-DeepSpeed's save
leaves them; every command reads it as before, and a reshard carries `args` back to DeepSpeed as
the same Namespace with the same enums.
"""

from __future__ import annotations

import argparse
import enum
import pickle
import shutil
import sys
import types

import pytest
import torch
from click.testing import CliRunner

from conftest import DATA, read_all

SOURCE = DATA / "ds_tp" / "mpu_z2_fp32"
pytestmark = pytest.mark.skipif(not SOURCE.is_dir(), reason="no tensor-parallel fixture (fixtures/generate_ds_tp.py)")


@pytest.fixture(scope="module")
def megatron_enums():
    """megatron.model.enums as Megatron-DeepSpeed defines them (pickle names classes by module)."""
    module = types.ModuleType("megatron.model.enums")

    class PositionEmbeddingType(enum.Enum):
        rotary = 1
        absolute = 2
        alibi = 3

    class AttnMaskType(enum.Enum):
        padding = 1
        causal = 2
        prefix = 3

    for cls in (PositionEmbeddingType, AttnMaskType):
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
    names = ("megatron", "megatron.model", "megatron.model.enums")
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update(
        {
            "megatron": types.ModuleType("megatron"),
            "megatron.model": types.ModuleType("megatron.model"),
            "megatron.model.enums": module,
        }
    )
    yield module
    for n, m in saved.items():
        if m is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = m


def _args(enums) -> argparse.Namespace:
    return argparse.Namespace(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        num_layers=2,
        hidden_size=16,
        params_dtype=torch.float32,
        lr=3e-4,
        seq_length=8,
        position_embedding_type=enums.PositionEmbeddingType.rotary,
        attn_mask_type=enums.AttnMaskType.causal,
        data_path=["/data/a", "/data/b"],
        fp16=False,
        bf16=False,
        seed=1234,
    )


@pytest.fixture()
def megatron_ckpt(tmp_path, megatron_enums):
    folder = tmp_path / "megatron"
    shutil.copytree(SOURCE, folder)
    args = _args(megatron_enums)
    for path in sorted(folder.glob("global_step*/mp_rank_*_model_states.pt")):
        state = torch.load(path, weights_only=False)  # our own fixture, trusted
        state.update(args=args, checkpoint_version=3.0, iteration=2, tokens=32)
        torch.save(state, path)
    return folder, args


def _cli(*argv: str):
    from ckptkit_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in argv], catch_exceptions=False)


def test_args_read_as_data_and_tensors_unchanged(megatron_ckpt):
    folder, args = megatron_ckpt
    _, want, _ = read_all(SOURCE)
    opened, got, objects = read_all(folder)
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor) and got[key].dtype == tensor.dtype, key
    shown = opened.index.objects["client.args"].data  # an inert stand-in: no Megatron code ran
    assert type(shown).__name__ == "Namespace" and shown.__dict__["hidden_size"] == 16
    assert objects["client.checkpoint_version"] == 3.0 and objects["ds.iteration"] == 2
    for command in (("inspect",), ("verify", "--deep")):
        res = _cli(*command, folder)
        assert res.exit_code == 0, res.output


def test_reshard_carries_args_back_to_deepspeed(megatron_ckpt, tmp_path, megatron_enums):
    folder, args = megatron_ckpt
    res = _cli("reshard", folder, tmp_path / "out", "--to", "tp=1,dp=2")
    assert res.exit_code == 0, res.output
    (model_file,) = (tmp_path / "out").glob("global_step*/mp_rank_00_model_states.pt")
    state = torch.load(model_file, weights_only=False)  # as DeepSpeed's load_checkpoint reads it
    assert isinstance(state["args"], argparse.Namespace)
    assert vars(state["args"]) == vars(args)
    assert state["args"].position_embedding_type is megatron_enums.PositionEmbeddingType.rotary
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 2


def test_a_namespace_cannot_carry_code():
    """Namespace is data only: it may hold plain values, never a callable global, and its state is
    a mapping of names; anything else is refused in one sentence naming the file."""
    import os

    from ckptkit.errors import CkptkitError
    from ckptkit.safeload import restricted_loads

    built = restricted_loads(pickle.dumps(argparse.Namespace(a=1, b=[2, 3]), protocol=2), "ok.pt")
    assert built.__dict__["a"] == 1 and built.__dict__["b"] == [2, 3]
    with pytest.raises(CkptkitError, match=r"calls\.pt.*(os|posix)\.system"):
        restricted_loads(pickle.dumps(argparse.Namespace(hook=os.system), protocol=2), "calls.pt")

    class Shadow:
        def __reduce__(self):
            return (argparse.Namespace, (), {"__class__": 1, "_qualname": "x"})  # names the stand-in's own

    with pytest.raises(CkptkitError, match=r"shadow\.pt"):
        restricted_loads(pickle.dumps(Shadow(), protocol=2), "shadow.pt")
