"""DeepSpeed ZeRO 1/2/3 checkpoints of optimizers other than DeepSpeed's Adam.

Fixtures (fixtures/data/deepspeed_optimizers, written by real DeepSpeed runs of
fixtures/generate_deepspeed.py's OPTIM_FIXTURES): torch's AdamW ("torch_adam": true, or a client
torch.optim.AdamW as the HF Trainer passes it), SGD with momentum, Adagrad and RMSprop (client
optimizers). Their truth holds every key of the optimizer's state, taken through DeepSpeed's own
safe_get_full_optimizer_state (and the group's own value for a 0-d step).

These tests read, inspect, consolidate --include-optimizer, reshard and diff them;
test_ds_engine_matrix.py has DeepSpeed load each 2 -> 3 reshard at 3 ranks with the same optimizer
and compare every state bit for bit.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from ckptkit.formats.registry import open_checkpoint
from ckptkit.ops.consolidate import consolidate
from ckptkit.ops.diff import diff
from ckptkit.convert.keys import split_roles
from ckptkit.ops.reshard import reshard
from conftest import DATA, assert_tensor_equal, read_all

OPT_DATA = DATA / "deepspeed_optimizers"
FIXTURES = sorted(p.name for p in OPT_DATA.iterdir() if p.is_dir()) if OPT_DATA.exists() else []
pytestmark = pytest.mark.skipif(
    not FIXTURES, reason="no optimizer fixtures (run fixtures/generate_deepspeed.py --only z2_sgd_fp32_w2 ...)"
)
# each optimizer's state keys, as torch names them (checked against the truth DeepSpeed gave)
EXPECTED_KEYS = {
    "torch_adam": {"step", "exp_avg", "exp_avg_sq"},
    "AdamW": {"step", "exp_avg", "exp_avg_sq"},
    "SGD": {"momentum_buffer"},
    "Adagrad": {"step", "sum"},
    "RMSprop": {"step", "square_avg", "momentum_buffer", "grad_avg"},
}


def _info(name: str) -> dict:
    return json.loads((OPT_DATA / name / "fixture.json").read_text())


def _truth(name: str) -> dict:
    return torch.load(OPT_DATA / f"{name}.truth.pt", weights_only=True)


def _states(truth: dict) -> dict[tuple[str, str], object]:
    """(param, state key) -> DeepSpeed's value."""
    out = {}
    for k, v in truth.items():
        if k.startswith("state."):
            key, _, param = k[len("state.") :].partition(".")
            out[(param, key)] = v
    return out


def _optimizer(name: str) -> str:
    versions = json.loads((OPT_DATA / "VERSIONS.json").read_text())
    return versions["fixtures"][name]["optimizer"]


def _equal_state(got, want, what: str) -> None:
    """A partitioned state as the tensor DeepSpeed gave; a whole one of the same type and value."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: {type(got).__name__}, DeepSpeed kept a tensor"
        assert_tensor_equal(got, want, what)
    else:
        assert type(got) is type(want) and got == want, f"{what}: {got!r} != {want!r}"


def _check_against_truth(path, name: str) -> int:
    """Every state key of every trainable parameter, and the masters, equal DeepSpeed's truth."""
    _, tensors, objects = read_all(path)
    truth = _truth(name)
    states = _states(truth)
    for (param, key), want in states.items():
        k = f"optim.state.{param}.{key}"
        _equal_state(tensors[k] if k in tensors else objects[k], want, f"{name}:{k}")
    for k, want in truth.items():
        if k.startswith("fp32."):
            assert_tensor_equal(tensors[f"model.{k[5:]}"], want, f"{name}:{k}")
    return len(states)


@pytest.mark.parametrize("name", FIXTURES)
def test_index_has_every_state_key_equal_to_deepspeed(name):
    truth = _truth(name)
    keys = set(truth["state_keys"])
    assert keys == EXPECTED_KEYS[_optimizer(name)], keys
    params = {k[5:] for k in truth if k.startswith("fp32.")}
    assert len(params) == 9
    assert _check_against_truth(OPT_DATA / name, name) == len(keys) * len(params)
    index = open_checkpoint(str(OPT_DATA / name)).index
    split = split_roles(index)
    for param in params:
        for key in keys:
            # every state key in the optimizer's role: partitioned ones as tensors, shaped like the param
            k = f"optim.state.{param}.{key}"
            if isinstance(truth[f"state.{key}.{param}"], torch.Tensor) and truth[f"state.{key}.{param}"].dim():
                assert split.optim[f"state.{param}.{key}"] == k
                assert index.tensors[k].shape == index.tensors[f"model.{param}"].shape
            else:
                assert split.optim_objects[f"state.{param}.{key}"] == k


@pytest.mark.parametrize("name", FIXTURES)
def test_inspect_counts_the_states_as_optimizer(name):
    from ckptkit_cli.main import cli

    truth = _truth(name)
    partitioned = {k for k, v in truth.items() if k.startswith("state.") and v.dim()}
    res = CliRunner().invoke(cli, ["inspect", str(OPT_DATA / name)])
    assert res.exit_code == 0, res.output
    m = re.search(r"(\d+) model, (\d+) optimizer, (\d+) other", res.output)
    assert m and int(m.group(2)) == len(partitioned) > 0 and int(m.group(3)) == 0, res.output


@pytest.mark.parametrize("name", FIXTURES)
def test_consolidate_include_optimizer_writes_every_state(tmp_path, name):
    truth = _truth(name)
    res = consolidate(str(OPT_DATA / name), str(tmp_path / "out"), include_optimizer=True)
    got: dict = {}
    objects: dict = {}
    for f in res.files:
        if f.startswith("optimizer") and f.endswith(".safetensors"):
            with safe_open(str(tmp_path / "out" / f), framework="pt") as st:
                got.update({k: st.get_tensor(k) for k in st.keys()})
                objects.update(json.loads(st.metadata().get("ckptkit.objects", "{}")))
    assert objects, "no optimizer values in the metadata"
    for (param, key), want in _states(truth).items():
        what = f"state.{param}.{key}"
        if isinstance(want, torch.Tensor) and want.dim():
            assert_tensor_equal(got[what], want, what)
        elif isinstance(want, torch.Tensor):  # torch's 0-d step, described with its dtype and value
            desc = objects[what]["__tensor__"]
            assert desc["dtype"] == str(want.dtype).removeprefix("torch.") and desc["shape"] == []
            assert desc["values"] == [want.item()], (what, desc)
        else:
            assert objects[what] == want, what
    partitioned = [v for k, v in truth.items() if k.startswith("state.") and v.dim()]
    assert res.optimizer_tensors == len(got) == len(partitioned)


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    base = tmp_path_factory.mktemp("optim_reshard")
    out = {}
    for name in FIXTURES:
        out[name] = base / f"{name}_to3"
        reshard(str(OPT_DATA / name), str(out[name]), 3)
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_reshard_keeps_every_state_and_diff_says_equal(resharded, name):
    assert open_checkpoint(str(resharded[name])).index.world_size == 3
    assert _check_against_truth(resharded[name], name) > 0
    result = diff(str(OPT_DATA / name), str(resharded[name]))
    assert result.equal, [r for r in result.rows if r.status not in ("equal", "one_side")][:5]
    compared = {r.name for r in result.rows if r.status == "equal"}
    for param, key in _states(_truth(name)):
        assert f"optimizer:state.{param}.{key}" in compared, (param, key)


def test_diff_compares_every_state_across_runs():
    """The same torch AdamW training in bf16 at ZeRO-2 and in fp32 at ZeRO-3: diff lines up every
    state key of both (names, stages and layouts differ), the steps equal, the moments not."""
    a, b = "z2_clientadamw_bf16_w2", "z3_torchadamw_fp32_w2"
    if a not in FIXTURES or b not in FIXTURES:
        pytest.skip(f"needs the fixtures {a} and {b}")
    rows = {r.name: r for r in diff(str(OPT_DATA / a), str(OPT_DATA / b)).rows}
    for param, key in _states(_truth(a)):
        row = rows[f"optimizer:state.{param}.{key}"]
        assert row.status == ("equal" if key == "step" else "different"), (param, key, row)


def test_unmappable_state_is_refused_in_one_sentence(monkeypatch):
    """A state no repartition can follow (Adafactor's factors, 8-bit blocks) is refused by the
    reader naming the file, the group and the key, exit 2. A real ZeRO run cannot write one (the
    optimizer only ever sees flat 1-D partitions, so Adafactor is never factored there): the real
    fixture's state key is renamed as the restricted loader returns it."""
    from ckptkit.formats.deepspeed import reader
    from ckptkit_cli.main import cli

    name = "z2_sgd_fp32_w2" if "z2_sgd_fp32_w2" in FIXTURES else FIXTURES[0]
    real = reader.load_structure

    def renamed(archive, eager=False, **kwargs):
        structure = real(archive, eager=eager, **kwargs)
        osd = structure.get("optimizer_state_dict") if isinstance(structure, dict) else None
        if isinstance(osd, dict):
            inner = osd.get("base_optimizer_state") or osd.get("optimizer_state_dict")
            for state in inner["state"].values():
                for key in list(state):
                    state["exp_avg_sq_row" if key != "step" else key] = state.pop(key)
        return structure

    monkeypatch.setattr(reader, "load_structure", renamed)
    res = CliRunner().invoke(cli, ["inspect", str(OPT_DATA / name)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    assert "optim_states.pt" in lines[0] and "group 0" in lines[0] and "'exp_avg_sq_row'" in lines[0]
    assert "cannot be mapped" in lines[0] and "Adafactor" in lines[0]


def test_whole_state_that_differs_between_ranks_is_refused(monkeypatch):
    """A value kept whole per group (torch's step) must be one value: ranks that disagree are
    refused by name, not resolved silently by taking one of them."""
    from ckptkit.errors import UnsupportedError
    from ckptkit.formats.deepspeed import group_state
    from ckptkit.torch_types import SmallTensor

    name = next((n for n in FIXTURES if "torchadamw" in n and n.startswith("z1")), None)
    if name is None:
        pytest.skip("needs the z1 torch AdamW fixture")
    real = group_state.materialize

    def rank1_ahead(value, archive):
        out = real(value, archive)
        if "zero_pp_rank_1_" in archive.label and isinstance(out, SmallTensor) and out.shape == ():
            return SmallTensor(out.dtype, (), torch.tensor(9.0, dtype=torch.float32).numpy().tobytes())
        return out

    monkeypatch.setattr(group_state, "materialize", rank1_ahead)
    with pytest.raises(UnsupportedError, match=r"optimizer state 'step' of group 0 is .* on rank 0"):
        open_checkpoint(str(OPT_DATA / name))
