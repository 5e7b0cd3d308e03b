"""reshard of DeepSpeed pipeline checkpoints to a new pp and dp: `reshard --to pp=P,dp=W`
(formats/deepspeed/split_pp.py, pipeline_stages.py; layers to stages by --partition-method, pipeline_partition.py).

Outputs read back equal at new sizes (with DeepSpeed's file set and stage boundaries), and a
rewrite at the same sizes being DeepSpeed's own files, are checked in test_layout_matrix.py with the
other layouts; here: a rewrite of a rewrite, the refusals and the partition functions equal to
DeepSpeed's. DeepSpeed loading outputs with the PipelineModule at the new sizes (every master,
moment, step and module weight equal to the truth of fixtures/generate_ds_pp.py, then a training
step): test_ds_engine_matrix.py.
"""

from __future__ import annotations

import random

import pytest

from ckptkit.errors import UsageError
from ckptkit.ops.reshard import reshard
from ckptkit.formats.deepspeed import pipeline_partition
from conftest import DATA
from helpers.ds_fixtures import needs_deepspeed
from helpers.corrupt import run_cli

PP_DATA = DATA / "ds_pp"
pytestmark = pytest.mark.skipif(
    not (PP_DATA / "pp2_dp2_z1_fp32").is_dir(), reason="no pipeline fixtures (run fixtures/generate_ds_pp.py)"
)

# the "type" fixture's partition_method and its layers' class names (fixtures/generate_ds_pp.py
# TYPE_METHOD, LAYER_TYPES): FrozenBlock and LayerNorm weigh 1, stages [0, 4, 6] at pp 2
TYPE = "type:layernorm|frozen"
LAYER_TYPES = "Embed,Block,FrozenBlock,Block,LayerNorm,Embed"


def test_a_rewrite_of_a_rewrite_is_the_source_again(tmp_path):
    """pp 2 -> 3 -> 2 (dp 2 -> 1 -> 2): the files equal the first rewrite at pp 2 byte for byte."""
    src = str(PP_DATA / "pp2_dp2_z1_fp32")
    reshard(src, str(tmp_path / "a"), "pp=2,dp=2")
    reshard(src, str(tmp_path / "b"), "pp=3,dp=1")
    reshard(str(tmp_path / "b"), str(tmp_path / "c"), "pp=2,dp=2")
    for f in sorted((tmp_path / "a" / "global_step2").iterdir()):
        assert (tmp_path / "c" / "global_step2" / f.name).read_bytes() == f.read_bytes(), f.name


def test_world_size_keeps_pp_and_equals_the_explicit_sizes(tmp_path):
    assert run_cli("reshard", PP_DATA / "pp2_dp2_z1_fp32", tmp_path / "n", "--to", "8").code == 0
    assert run_cli("reshard", PP_DATA / "pp2_dp2_z1_fp32", tmp_path / "s", "--to", "pp=2,dp=4").code == 0
    names = sorted(p.name for p in (tmp_path / "s" / "global_step2").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "n" / "global_step2").iterdir())
    for n in names:
        assert (tmp_path / "n" / "global_step2" / n).read_bytes() == (tmp_path / "s" / "global_step2" / n).read_bytes()


@pytest.mark.parametrize(
    "name,args,code,needles",
    [
        (
            "pp2_dp2_z1_fp32",
            ["--to", "tp=2,pp=2,dp=1"],
            2,
            ["adding tensor parallelism", "give pp=...,dp=... with tp=1"],
        ),
        ("pp2_dp2_z1_fp32", ["--to", "ep=2,pp=2"], 2, ["no mixture-of-experts layers, so ep must be 1"]),
        ("pp2_dp2_z1_fp32", ["--to", "3"], 2, ["pipeline size 2 does not divide 3 ranks", "--to pp=1,dp=3"]),
        ("pp2_dp2_z1_fp32", ["--to", "pp=7,dp=1"], 2, ["has 6 layers, fewer than the 7 pipeline stages"]),
        ("pp1_dp2_z1_fp32", ["--to", "pp=2,dp=1"], 2, ["single-stage pipeline checkpoint with tied modules (embed)"]),
        (
            "pp2_dp2_z1_fp32",
            ["--to", "pp=2,dp=1", "--partition-method", "type:Block"],
            2,
            ["does not record its layers' class names, which type: matches; give them with --layer-types"],
        ),
        (
            "pp2_dp2_z1_fp32",
            ["--to", "pp=3,dp=1", "--partition-method", "type:zzz", "--layer-types", LAYER_TYPES],
            2,
            ["no name in --layer-types matches 'zzz'"],
        ),
        (
            "pp2_dp2_z1_fp32",
            ["--to", "pp=3,dp=1", "--partition-method", "type:(", "--layer-types", LAYER_TYPES],
            2,
            ["'(' is not a regular expression"],
        ),
        (
            "pp2_dp2_z1_fp32",
            ["--to", "pp=3,dp=1", "--partition-method", "blocks"],
            2,
            ["'blocks': expected one of parameters, uniform, type:REGEX"],
        ),
        (
            "pp2_dp2_z1_fp32",
            ["--to", "pp=3,dp=1", "--layer-types", "Embed,Block*"],
            2,
            ["'Block*' is not a layer's class"],
        ),
        (
            "pp2_dp2_z1_fp32",
            ["--to", "pp=3,dp=1", "--layer-types", "Embed,Block*4"],
            2,
            ["--layer-types names 5 layers, but", "holds state of layer 5"],
        ),
        (
            "pp2_dp1_z1_fp32_type",
            ["--to", "pp=3,dp=1", "--partition-method", "uniform"],
            2,  # 8 layers would fit
            ["depends on how many state-less layers follow layer 5", "without --layer-types"],
        ),
        (
            "pp2_dp1_z1_fp32_type",
            ["--to", "pp=3,dp=1", "--partition-method", "uniform", "--layer-types", LAYER_TYPES],
            2,
            ["do not split into its 2 stages with --partition-method uniform (layer 3 is on stage 0"],
        ),
        (
            "pp2_dp1_z1_fp32_type",
            ["--to", "pp=3,dp=1", "--partition-method", "type:block", "--layer-types", LAYER_TYPES],
            2,
            ["(as inferred from the checkpoint and --layer-types (6 layers)) do not split into its 2 stages"],
        ),
    ],
)
def test_sizes_that_cannot_be_written_are_refused(tmp_path, name, args, code, needles):
    res = run_cli("reshard", PP_DATA / name, tmp_path / "out", *args)
    assert res.code == code, res.output
    assert all(n in res.output for n in needles) and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_stages_the_checkpoint_does_not_determine_are_refused():
    """new_stages' checks can fire: a source whose layer stages the method cannot give, and one that
    says nothing of its stages (so unseen trailing state-less layers would move the boundaries)."""
    from ckptkit.errors import UnsupportedError
    from ckptkit.formats.deepspeed import pipeline_stages
    from ckptkit.formats.registry import open_checkpoint

    index = open_checkpoint(str(PP_DATA / "pp2_dp2_z1_fp32")).index
    layers, stage_of = pipeline_stages.layer_table(index)
    assert [x.kind for x in layers] == ["tied", "layer", "layer", "layer", "layer", "tied"]
    assert stage_of == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    _, parts = pipeline_stages.new_stages(index, layers, stage_of, "uniform", 4)
    assert parts == [0, 2, 4, 5, 6]
    with pytest.raises(UnsupportedError, match=r"do not split into its 2 stages with --partition-method uniform"):
        pipeline_stages.new_stages(index, layers, {0: 1}, "uniform", 4)
    with pytest.raises(UnsupportedError, match=r"depends on how many state-less layers follow layer 5"):
        pipeline_stages.new_stages(index, layers, {}, "uniform", 4)


def test_layer_types_fix_the_layer_count():
    """Unseen trailing state-less layers: refused without --layer-types, placed with them."""
    from ckptkit.formats.deepspeed import pipeline_stages
    from ckptkit.formats.registry import open_checkpoint

    index = open_checkpoint(str(PP_DATA / "pp2_dp2_z1_fp32")).index
    layers, _ = pipeline_stages.layer_table(index)
    with pytest.raises(UsageError, match=r"does not record its layers' class names"):
        pipeline_stages.new_stages(index, layers, {}, "type:block", 4)
    types = pipeline_partition.parse_layer_types(LAYER_TYPES + ",head*2")
    cand, parts = pipeline_stages.new_stages(index, layers, {}, "uniform", 4, types)
    assert len(cand) == 8 and parts == [0, 2, 4, 6, 8]  # partition_uniform(8, 4)
    cand, parts = pipeline_stages.new_stages(index, layers, {}, "type:block|head", 4, types)
    assert len(cand) == 8 and parts == pipeline_partition.partition_balanced([0, 1, 1, 1, 0, 0, 1, 1], 4)


@needs_deepspeed
def test_type_weights_equal_deepspeeds_find_layer_type():
    """type:REGEX: the layers DeepSpeed's PipelineModule._find_layer_type finds (LayerSpec, tied,
    module and function layers, lambdas), from the names --layer-types gives, and the stages."""
    from types import SimpleNamespace

    import torch.nn as nn
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.utils import partition_balanced

    class EmbeddingPipe(nn.Linear):
        pass

    class ParallelTransformerLayerPipe(nn.Linear):
        pass

    def float16_to_fp32(x):
        return x

    specs = [
        TiedLayerSpec("embed", EmbeddingPipe, 2, 2),
        lambda x: x,
        *[LayerSpec(ParallelTransformerLayerPipe, 2, 2) for _ in range(5)],
        lambda x: x,
        LayerSpec(nn.LayerNorm, 2),
        TiedLayerSpec("embed", EmbeddingPipe, 2, 2, forward_fn=lambda m, x: x),
        float16_to_fp32,
        nn.ReLU(),
    ]
    types = pipeline_partition.parse_layer_types(
        "EmbeddingPipe,<lambda>,ParallelTransformerLayerPipe*5,<lambda>,LayerNorm,EmbeddingPipe,float16_to_fp32,ReLU"
    )
    assert len(types) == len(specs)
    stub = SimpleNamespace(_layer_specs=specs)
    for method in [
        "type:transformer",
        "type:Transformer|embedding",
        "type:^layernorm$",
        "type:fp32|lambda",
        "type:relu",
        "type:pipe:ignored after the second colon",
        "type:[A-Z]mbed",
    ]:
        want = [0] * len(specs)
        for i in PipelineModule._find_layer_type(stub, method.lower().split(":")[1]):  # as _partition_layers
            want[i] = 1
        assert pipeline_partition.type_weights(method, types) == want, method
        for m in range(1, 8):
            assert pipeline_partition.partition(method, want, m) == [int(x) for x in partition_balanced(want, m)]
    with pytest.raises(RuntimeError, match="found no valid layers"):
        PipelineModule._find_layer_type(stub, "zzz")
    with pytest.raises(UsageError, match="no name in --layer-types matches 'zzz'"):
        pipeline_partition.type_weights("type:zzz", types)


@needs_deepspeed
def test_partition_functions_equal_deepspeeds():
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    rng = random.Random(7)
    for n in range(0, 11):
        for m in range(1, 8):
            assert pipeline_partition.partition_uniform(n, m) == list(partition_uniform(n, m)), (n, m)
            for _ in range(6):
                w = [rng.choice([0, 1, 16, 72, 88, 110, rng.randint(0, 500)]) for _ in range(n)]
                want = [int(x) for x in partition_balanced(w, m)]
                assert pipeline_partition.partition_balanced(w, m) == want, (w, m)
