"""A careless user and an attacker against the in-job API: the arguments of ckptkit.save and the
Checkpointer (what they share and the contract: tests/helpers/cli_contract.py).
"""

from __future__ import annotations

import pytest
import torch

import ckptkit
from ckptkit.errors import CkptkitError, UsageError


# ---- the in-job API ------------------------------------------------------------------------------


def test_save_refuses_two_entries_that_flatten_to_one_name(tmp_path):
    out = tmp_path / "c"
    with pytest.raises(CkptkitError, match="a.b"):
        ckptkit.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, str(out))
    assert not out.exists()


def test_checkpointer_path_refuses_a_step_save_refuses(tmp_path):
    ckpt = ckptkit.Checkpointer(str(tmp_path / "run"))
    with pytest.raises(CkptkitError, match="step"):
        ckpt.path(-1)


# ---- the Checkpointer ----------------------------------------------------------------------------


def test_a_step_the_checkpointer_commits_can_be_restored(tmp_path):
    import fractions

    model = torch.nn.Linear(2, 2)
    ckpt = ckptkit.Checkpointer(str(tmp_path / "run"))
    try:
        ckpt.save(1, model, extra={"o": fractions.Fraction(1, 3)})
    except CkptkitError:  # refusing what extra may not hold is a fix too: then nothing is committed
        assert ckpt.steps() == []
        return
    assert ckptkit.Checkpointer(str(tmp_path / "run")).restore(model) == 1


def test_an_extra_value_that_cannot_be_saved_is_a_ckptkit_error(tmp_path):
    ckpt = ckptkit.Checkpointer(str(tmp_path / "run"))
    with pytest.raises(CkptkitError, match="extra"):
        ckpt.save(1, torch.nn.Linear(2, 2), extra={"f": lambda: 1})
    assert ckpt.steps() == []


@pytest.mark.parametrize("model", [{"w": torch.ones(2)}, None], ids=["dict", "none"])
def test_save_of_something_that_is_no_model_is_a_usage_error(tmp_path, model):
    with pytest.raises(CkptkitError):
        ckptkit.Checkpointer(str(tmp_path / "run")).save(1, model)


def test_a_pointer_that_cannot_be_written_leaves_no_temporary(tmp_path):
    import warnings

    run = tmp_path / "run"
    (run / "latest").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckptkit.Checkpointer(str(run)).save(1, torch.nn.Linear(2, 2))
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_000000001"]


def test_a_checkpointer_on_a_file_says_the_path_is_a_file(tmp_path):
    where = tmp_path / "a file"
    where.write_text("not a folder")
    with pytest.raises(CkptkitError, match="is a file"):
        ckptkit.Checkpointer(str(where)).restore(torch.nn.Linear(2, 2))
    assert where.read_text() == "not a folder"


@pytest.mark.parametrize("extra", [[1, 2], (1, 2), "epoch=3"], ids=["list", "tuple", "str"])
def test_extra_that_is_no_dict_is_refused_before_anything_is_written(tmp_path, extra):
    run = tmp_path / "run"
    ckpt = ckptkit.Checkpointer(str(run))
    with pytest.raises(CkptkitError, match="extra must be a dict"):
        ckpt.save(1, torch.nn.Linear(2, 2), extra=extra)
    assert ckpt.steps() == [] and sorted(p.name for p in run.iterdir()) == []


@pytest.mark.parametrize(
    "extra,states_dict",
    [
        ({1: torch.ones(1)}, None),
        ({"n": {2: 3}}, None),
        ({"l": [{None: 1}]}, None),
        (None, {5: 1, "a": 2}),
    ],
    ids=["int key", "nested int key", "None key in a list", "int key in a state"],
)
def test_a_key_restore_would_give_back_as_text_is_refused_before_writing(tmp_path, extra, states_dict):
    """DCP joins nested dict keys into dotted names: {1: x} came back from restore as {'1': x}."""

    class Stateful:
        def state_dict(self):
            return states_dict

        def load_state_dict(self, d):
            pass

    ck = ckptkit.Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(UsageError, match="keys must be str"):
        ck.save(1, torch.nn.Linear(2, 2), extra=extra, states={"s": Stateful()} if states_dict else None)
    assert ck.steps() == [] and not [p for p in (tmp_path / "ck").iterdir() if not p.name.startswith(".")]
    ck.save(1, torch.nn.Linear(2, 2), extra={"fine": {"a": [1, {"b": 2}]}})  # the Checkpointer stays usable
    assert ck.steps() == [1]
