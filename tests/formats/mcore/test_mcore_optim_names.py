"""MCore's optimizer-state names and param grouping, both ways (formats/mcore/optim_names.py): what
the reader maps to per-layer names and a writer maps back. The rule is megatron-core 0.16.1's
`_get_param_groups` with its standard overrides (wd_mult 0.0 for `*.bias` and 1-D parameters,
expert parameters apart); the fixtures' own groups are checked against it in test_mcore_convert.py."""

from __future__ import annotations

import pytest

from ckptkit.formats.mcore import optim_names as on


@pytest.mark.parametrize(
    "key, parts",
    [
        (
            "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",
            (None, "exp_avg", "decoder.layers.mlp.linear_fc1.weight"),
        ),
        (
            "chained_1.optimizer.state.param.embedding.word_embeddings.weight",
            (1, "param", "embedding.word_embeddings.weight"),
        ),
    ],
)
def test_a_state_key_is_taken_apart_and_put_back(key, parts):
    assert on.split_state_key(key) == parts
    assert on.state_key(parts[2], parts[1], parts[0]) == key


def test_the_common_step_and_model_keys_are_no_parameters_state():
    assert on.split_state_key("optimizer.state.common_step") is None
    assert on.common_step_chain("chained_0.optimizer.state.common_step") == 0
    assert on.common_step_chain("optimizer.state.common_step") is None
    assert on.split_state_key("decoder.layers.mlp.linear_fc1.weight") is None


def test_layer_and_expert_names_invert():
    names = on.layer_names("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 3, 8, 4))
    assert len(names) == 6 and names[5] == ("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", (1, 2))
    for name, at in names + on.layer_names("decoder.layers.mlp.linear_fc2.weight", (2, 4, 8)):
        stacked, back = on.stacked_name(name)
        assert back == at and on.layer_names(stacked, (2, 3, 8, 4))[0][0].startswith("decoder.layers.0.")


def test_a_layers_own_name_and_a_whole_tensor_are_not_unstacked():
    assert on.layer_names("decoder.layers.0.mlp.linear_fc1.weight", (64, 16)) == [
        ("decoder.layers.0.mlp.linear_fc1.weight", ())
    ]
    assert on.layer_names("embedding.word_embeddings.weight", (64, 16)) == [("embedding.word_embeddings.weight", ())]


def test_members_follow_megatrons_standard_grouping():
    groups = [{"wd_mult": 1.0, "is_expert_parallel": False}, {"wd_mult": 0.0, "is_expert_parallel": False}]
    params = [("a.weight", (4, 4)), ("a.bias", (4,)), ("norm.weight", (4,)), ("odd.bias", (4, 4))]
    members, why = on.member_groups(groups, params)
    assert why == "" and members == [["a.weight"], ["a.bias", "norm.weight", "odd.bias"]]


@pytest.mark.parametrize(
    "groups, said",
    [
        ([{"wd_mult": 1.0, "lr_mult": 2.0}], "multipliers MCore's standard grouping does not make"),
        ([{"wd_mult": 1.0}, {"wd_mult": 1.0}], "the same weight-decay and expert settings"),
        ([{"wd_mult": 1.0}], "fits none of the saved param groups"),
    ],
)
def test_groups_no_rule_explains_are_said(groups, said):
    members, why = on.member_groups(groups, [("a.weight", (4, 4)), ("a.bias", (4,))])
    assert members == [] and said in why
