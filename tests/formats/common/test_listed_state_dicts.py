"""A trainer checkpoint's nested state dict must be a mapping of names to tensors: a model or
optimizer stored as a list or tuple (in a torch.save file or a DCP folder) is refused naming the
file, the key and what was expected; other lists and mapped state dicts still read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.corrupt import assert_error, run_cli


def _save(path: Path, obj) -> Path:
    import torch

    torch.save(obj, path)
    return path


def _as_list(kind: str):
    import torch

    values = [torch.ones(2), torch.zeros(3)]
    return values if kind == "list" else tuple(values)


@pytest.mark.parametrize("kind", ["list", "tuple"])
@pytest.mark.parametrize(
    "key,name,extra",
    [
        ("state_dict", "lightning.ckpt", {"pytorch-lightning_version": "2.4.0", "global_step": 3}),  # Lightning
        ("module", "mp_rank_00_model_states.bin", {}),  # DeepSpeed's module key in a plain torch.save
        ("model", "pytorch_model.bin", {}),  # accelerate / FSDP full state dict {"model": ...}
        ("model_state_dict", "checkpoint.pt", {"epoch": 1}),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "consolidate", "convert"])
def test_a_listed_state_dict_is_refused(command, key, name, extra, kind, tmp_path):
    src = _save(tmp_path / name, {key: _as_list(kind), **extra})
    out = tmp_path / "OUT"
    args = {"inspect": [src], "consolidate": [src, out], "convert": [src, out, "--to", "torch"]}[command]
    res = run_cli(command, *args)
    assert_error(res, str(src), repr(key), "mapping", out=out)
    assert not out.exists()


def test_the_refusal_names_file_key_and_what_was_expected(tmp_path):
    from ckptkit.errors import FormatError
    from ckptkit.formats.registry import open_checkpoint

    src = _save(tmp_path / "list.ckpt", {"state_dict": _as_list("list"), "pytorch-lightning_version": "2.4.0"})
    with pytest.raises(FormatError) as exc:
        open_checkpoint(str(src))
    msg = str(exc.value)
    assert msg.startswith(f"{src}: ") and "'state_dict'" in msg and "list" in msg, msg
    assert "mapping of parameter names to tensors" in msg, msg


def test_the_reader_knows_every_model_container():
    """The reader's list of keys that hold a state dict is the one the model is found under."""
    from ckptkit.convert.keys import MODEL_CONTAINERS
    from ckptkit.formats.torch_save.reader import STATE_DICT_KEYS

    assert set(STATE_DICT_KEYS) == set(MODEL_CONTAINERS)


def test_other_lists_and_mapped_state_dicts_still_read(tmp_path):
    """Lightning's optimizer_states is a list, and a state dict as a mapping reads as before."""
    import torch
    from ckptkit.formats.registry import open_checkpoint

    src = _save(
        tmp_path / "ok.ckpt",
        {
            "state_dict": {"model.w": torch.ones(2)},
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
            "pytorch-lightning_version": "2.4.0",
        },
    )
    index = open_checkpoint(str(src)).index
    assert "state_dict.model.w" in index.tensors


def test_a_listed_model_in_a_dcp_folder_is_refused(tmp_path):
    """DCP flattens a list under "model" to model.0, model.1 (accelerate's and Lightning's FSDP
    folders are DCP): refused like the torch.save file, naming the folder and the key."""
    import torch
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"model": [torch.ones(2), torch.zeros(3)]}, checkpoint_id=str(src), no_dist=True)
    out = tmp_path / "OUT"
    res = run_cli("consolidate", src, out)
    assert_error(res, str(src), "'model'", "mapping of parameter names to tensors", out=out)
    res = run_cli("inspect", src)
    assert_error(res, str(src), "'model'")
