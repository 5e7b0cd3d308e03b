"""Adding tensor parallelism to DeepSpeed checkpoints saved without it (grow_tp.py): `reshard --to
tp=2,... --tp-rules FILE` of a MoE and of a pipeline checkpoint DeepSpeed wrote at tp 1
(fixtures/data/ds_grow_tp/: the Megatron-style models of fixtures/ds_moe_tp_models.py and
fixtures/generate_ds_3d.py, saved at tp 1; their truth from DeepSpeed's own API).

The output read back (with the same rules) equals the source; every rank file DeepSpeed loads
holds that rank's slice of DeepSpeed's truth under the model's own split (the generator's
`split.<name>`, which docs/tp_rules.grow.json restates); refusals are one sentence. DeepSpeed loads
the grown pipeline at tp 2 x pp 2 (tests/dist/ds_3d_load_check.py) and the grown MoE at tp 4 in
test_ds_engine_matrix.py's launch of 4 ranks (its "3d_grown" and "moe_tp_grown" cases).
"""

from __future__ import annotations


import pytest
import torch
from click.testing import CliRunner

from ckptkit.convert.tp_rules import use_rules_file
from ckptkit.ops.reshard import reshard
from conftest import DATA, ROOT, assert_tensor_equal, read_all
from helpers.hostile import Scene, check_refused, run_ckptkit

GROWN = DATA / "ds_grow_tp"
MOE = GROWN / "moe" / "moetp_z2_fp32_tp1_ep2_w2"
PP = GROWN / "pp" / "pp2_tp1_dp2_z1_fp32"
RULES = ROOT / "docs" / "tp_rules.grow.json"
TAG = "global_step2"
EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."
pytestmark = pytest.mark.skipif(
    not (MOE.is_dir() and PP.is_dir()), reason="no tp-1 fixtures (fixtures/generate_ds_moe_tp.py --grown, 3d --grown)"
)


def _truth(src):
    return torch.load(src.parent / f"{src.name}.truth.pt", weights_only=True)


def _slice(full: torch.Tensor, split: tuple, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s part of `full` under the generator's split tuple (fixtures/ds_tp_models.slice_of)."""
    if split[0] == "replicated":
        return full
    if split[0] == "split":
        return full.chunk(tp, dim=split[1])[rank]
    _, dim, parts = split
    return torch.cat([p.chunk(tp, dim=dim)[rank] for p in full.chunk(parts, dim=dim)], dim=dim)


@pytest.fixture(scope="module")
def grown_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("grow") / "moe"
    reshard(str(MOE), str(out), "tp=2,ep=2,dp=2", tp_rules=str(RULES))
    return out


@pytest.fixture(scope="module")
def grown_pp(tmp_path_factory):
    from ckptkit_cli.main import cli

    out = tmp_path_factory.mktemp("grow") / "pp"
    args = ["reshard", PP, out, "--to", "tp=2,pp=2,dp=1", "--tp-rules", RULES, "--partition-method", "uniform"]
    res = CliRunner().invoke(cli, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return out


def _read_with_rules(path):
    use_rules_file(str(RULES))
    try:
        return read_all(path)
    finally:
        use_rules_file(None)


@pytest.mark.parametrize("which", ["moe", "pp"])
def test_grown_checkpoint_reads_back_as_the_source(which, grown_moe, grown_pp):
    src, out = (MOE, grown_moe) if which == "moe" else (PP, grown_pp)
    _, want, _ = read_all(src)
    opened, got, _ = _read_with_rules(out)
    assert opened.index.metadata["parallel"]["tp"] == 2
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert_tensor_equal(got[key], value, key)


def test_moe_rank_files_hold_each_ranks_slice_of_the_truth(grown_moe):
    """mp_rank_0t's module and expert_file(0, g, t) hold tp rank t's slice of DeepSpeed's truth."""
    truth = _truth(MOE)
    names = [k[len("module.") :] for k in truth if k.startswith("module.")]
    seen = 0
    for t in range(2):
        module = torch.load(grown_moe / TAG / f"mp_rank_0{t}_model_states.pt", weights_only=True)["module"]
        experts = {}
        for g in range(4):
            experts.update(
                torch.load(grown_moe / TAG / f"layer_0_expert_{g}_mp_rank_0{t}_model_states.pt", weights_only=True)
            )
        for name in names:
            want = _slice(truth[f"module.{name}"], truth[f"split.{name}"], t, 2)
            got = experts[name] if EXPERTS in name else module[name]
            assert_tensor_equal(got, want, f"tp rank {t}: {name}")
            seen += 1
    assert seen == 2 * len(names) and len(names) == 28  # 12 dense, 4 per expert


def test_pipeline_layer_files_hold_each_ranks_slice_of_the_truth(grown_pp):
    """layer_XX-model_0t holds tp rank t's slice of DeepSpeed's truth for layer XX's weights."""
    truth = _truth(PP)
    names = [k[len("module.") :] for k in truth if k.startswith("module.")]
    for t in range(2):
        for name in names:
            layer, rest = name.split(".", 1)
            state = torch.load(grown_pp / TAG / f"layer_{int(layer):02d}-model_0{t}-model_states.pt", weights_only=True)
            want = _slice(truth[f"module.{name}"], truth[f"split.{name}"], t, 2)
            assert_tensor_equal(state[rest], want, f"tp rank {t}: {name}")
    assert len(names) == 28  # embedding, 12 per layer x 2, final norm (2), head


def test_grown_model_files_record_the_new_sizes(grown_moe):
    model = torch.load(grown_moe / TAG / "mp_rank_01_model_states.pt", weights_only=True)
    assert (model["mp_world_size"], model["dp_world_size"]) == (2, 2)


def _refused(tmp_path, src, to, rules_text, *needles):
    args = ["reshard", src, tmp_path / "out", "--to", to]
    if rules_text is not None:
        rules = tmp_path / "rules.json"
        rules.write_text(rules_text)
        args += ["--tp-rules", rules]
    check_refused(run_ckptkit(*args), *needles, scene=Scene(src, tmp_path / "out"))


def test_adding_tp_without_rules_names_the_option(tmp_path):
    _refused(tmp_path, MOE, "tp=2,ep=2,dp=2", None, "adding tensor parallelism", "--tp-rules FILE")


def test_a_rule_naming_a_parameter_the_checkpoint_lacks_is_refused(tmp_path):
    rules = '{"rules": [{"pattern": "module.word_embeddings.weight", "split": 0}]}'
    _refused(tmp_path, PP, "tp=2,pp=2,dp=1", rules, "'module.word_embeddings.weight' names a parameter")


def test_a_dimension_tp_does_not_divide_is_refused(tmp_path):
    rules = '{"rules": [{"pattern": "*.input_layernorm.weight", "split": 0}]}'
    _refused(tmp_path, MOE, "tp=3,ep=2,dp=2", rules, "cannot share equally", "saved without tp")


def test_a_parameter_no_rule_decides_is_refused(tmp_path):
    rules = '{"builtin": false, "rules": [{"pattern": "*word_embeddings.weight", "split": 0}]}'
    _refused(tmp_path, MOE, "tp=2,ep=2,dp=2", rules, "adding tensor parallelism", "no tensor-parallel split rule")


def test_a_rule_splitting_a_dimension_the_parameter_lacks_is_refused(tmp_path):
    rules = '{"rules": [{"pattern": "*final_layernorm.bias", "split": 1}]}'
    _refused(tmp_path, MOE, "tp=2,ep=2,dp=2", rules, "splits dimension 1", "final_layernorm.bias")
