"""DeepSpeedLayout read off the real DeepSpeed fixtures (sizes as the generating run recorded them in
fixture.json, naming variants as the files on disk show them), its rank rules against the files
DeepSpeed wrote, and `resized`: the sizes a reshard may ask for, and each refusal's sentence."""

from __future__ import annotations

import json
import os

import pytest

from ckptkit.errors import UnsupportedError, UsageError
from ckptkit.formats.deepspeed import names
from ckptkit.formats.deepspeed.format import detect_layout
from ckptkit.formats.deepspeed.layout import RESIZE_RULES, DeepSpeedLayout
from ckptkit.formats.registry import open_checkpoint
from ckptkit.index.parallel_spec import ParallelSizes, parse_parallel
from ckptkit.storage.source import LocalSource
from conftest import DATA

FAMILY_OF_FOLDER = {  # fixture folder -> the layout family its checkpoints are
    "deepspeed": "zero",
    "ds_tp": "tensor_parallel",
    "ds_pp": "pipeline",
    "ds_3d": "pipeline_tp",
    "ds_moe": "moe",
    "ds_moe_tp": "moe_tp",
    "ds_pp_moe": "pipeline_moe",
}
UNREADABLE = {  # fixtures ckptkit refuses to read (their own tests pin why)
    "ds_pp/pp2_dp1_z0_fp32",  # ZeRO stage 0 in fp32: optimizer state in the model files
    "ds_moe_tp/moetp_noexptp_z2_fp32_tp2_ep1_w4",  # whole experts at ep < tp: DeepSpeed loses weights
}


def _fixtures() -> list[str]:
    found = []
    for folder in FAMILY_OF_FOLDER:
        root = DATA / folder
        if root.is_dir():
            found += [f"{folder}/{n}" for n in sorted(os.listdir(root)) if (root / n / "fixture.json").is_file()]
    return [f for f in found if f not in UNREADABLE]


FIXTURES = _fixtures()
_OPENED: dict[str, object] = {}


def _index(fixture: str):
    if fixture not in _OPENED:
        _OPENED[fixture] = open_checkpoint(str(DATA / fixture)).index
    return _OPENED[fixture]


def _tag_names(fixture: str) -> list[str]:
    root = DATA / fixture
    tag = (root / names.LATEST).read_text().strip()
    return sorted(os.listdir(root / tag))


@pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures in fixtures/data (fixtures/generate_*.py)")
@pytest.mark.parametrize("fixture", FIXTURES)
def test_layout_matches_the_run_that_wrote_the_fixture(fixture):
    recorded = json.loads((DATA / fixture / "fixture.json").read_text())
    layout = DeepSpeedLayout.of(_index(fixture))
    for size in ("tp", "pp", "ep", "dp"):
        if size in recorded:
            assert getattr(layout, size) == recorded[size], size
    stage = recorded.get("stage", recorded.get("zero_stage"))
    assert layout.zero_stage == stage
    if "world_size" in recorded:
        assert layout.tp * layout.pp * layout.dp == recorded["world_size"]
    on_disk = _tag_names(fixture)
    assert layout.bf16_prefix == any(n.startswith(names.BF16_PREFIX) for n in on_disk)
    layer_files = [parsed for n in on_disk if (parsed := names.parse_layer_file(n))]
    assert layout.megatron_layer_names == any(tp_rank is not None for _, tp_rank in layer_files)
    assert (layout.stages == "layer_files") == bool(layer_files)
    assert layout.has_experts == any(names.parse_expert_file(n) for n in on_disk)


@pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures in fixtures/data (fixtures/generate_*.py)")
@pytest.mark.parametrize("fixture", FIXTURES)
def test_family_is_the_fixture_folders_combination(fixture):
    """Each combination is told from the fields alone: a tensor-parallel checkpoint with experts is
    moe_tp (or moe_whole_tp), never tensor_parallel, whose writer would drop the expert files."""
    folder, name = fixture.split("/")
    expected = FAMILY_OF_FOLDER[folder]
    if expected == "moe_tp" and "noexptp" in name:  # enable_expert_tensor_parallelism=False
        expected = "moe_whole_tp"
    layout = DeepSpeedLayout.of(_index(fixture))
    assert layout.family == expected
    assert layout.experts == ("whole" if expected == "moe_whole_tp" else "none" if "moe" not in expected else "sliced")


@pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures in fixtures/data (fixtures/generate_*.py)")
@pytest.mark.parametrize("fixture", FIXTURES)
def test_every_cell_has_the_model_and_optim_files_the_rank_rules_name(fixture):
    layout = DeepSpeedLayout.of(_index(fixture))
    on_disk = set(_tag_names(fixture))
    stage_count = layout.pp if layout.stages != "none" else 1
    mp_ranks = sorted(layout.mp_rank(s, t) for s in range(stage_count) for t in range(layout.tp))
    assert mp_ranks == list(range(stage_count * layout.tp))
    for mp in mp_ranks:
        assert layout.cell(mp) == divmod(mp, layout.tp)
        assert set(layout.model_files(mp)) <= on_disk
        assert set(layout.optim_files(mp)) <= on_disk
    assert names.optim_file(layout.dp, layout.bf16_prefix, 0) not in on_disk


WHOLE = "ds_moe_tp/moetp_noexptp_z2_fp32_tp2_ep2_w4"


@pytest.mark.skipif(WHOLE not in FIXTURES, reason=f"fixture {WHOLE} not generated")
def test_whole_experts_are_saved_by_the_mp_rank_the_rule_names():
    layout = DeepSpeedLayout.of(_index(WHOLE))
    counts = dict(layout.num_experts)
    per_rank = next(iter(counts.values())) // layout.ep
    on_disk = set(_tag_names(WHOLE))
    for ep_rank in range(layout.ep):
        for expert in range(ep_rank * per_rank, (ep_rank + 1) * per_rank):
            saver = layout.expert_saver(ep_rank)
            assert names.expert_file(0, expert, saver) in on_disk
            others = [t for t in range(layout.tp) if t != saver]
            assert not any(names.expert_file(0, expert, t) in on_disk for t in others)
    assert layout.expert_partitions() == layout.tp * layout.dp // layout.ep


@pytest.mark.skipif(not FIXTURES, reason="no DeepSpeed fixtures in fixtures/data (fixtures/generate_*.py)")
@pytest.mark.parametrize("fixture", [f for f in FIXTURES if f.endswith(("_w2", "_w4", "_fp32"))][::3])
def test_detect_reads_the_same_layout_from_the_files(fixture):
    assert detect_layout(LocalSource(str(DATA / fixture))) == DeepSpeedLayout.of(_index(fixture))


def test_every_fixture_family_has_one_resize_rule():
    assert set(FAMILY_OF_FOLDER.values()) | {"moe_whole_tp"} == set(RESIZE_RULES)


KEPT = [  # (fixture, --to N, the sizes a world size keeps)
    ("ds_3d/pp2_tp2_dp2_z1_fp32", "8", ParallelSizes(tp=2, pp=2, dp=2)),
    ("ds_moe_tp/moetp_noexptp_z2_fp32_tp2_ep2_w4", "8", ParallelSizes(tp=2, ep=2, dp=4)),
    ("ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4", "8", ParallelSizes(pp=2, ep=2, dp=4)),
    ("ds_moe/moe_z1_fp32_w2_k1", "4", ParallelSizes(ep=2, dp=4)),
    ("deepspeed/z1_fp16_w2", "3", ParallelSizes(dp=3)),
    ("deepspeed/z1_fp16_w2", "dp=5", ParallelSizes(dp=5)),
    ("ds_tp/mpu_z2_fp32", "tp=1,dp=3", ParallelSizes(dp=3)),
]


@pytest.mark.parametrize(("fixture", "to", "sizes"), KEPT)
def test_resized_keeps_the_model_parallel_sizes_a_world_size_does_not_name(fixture, to, sizes):
    if fixture not in FIXTURES:
        pytest.skip(f"fixture {fixture} not generated")
    index = _index(fixture)
    assert DeepSpeedLayout.of(index).resized(parse_parallel(to), index.root) == sizes


WHOLE_TP_LOOKUP = (
    "the tensor-parallel size must divide the expert-parallel size: DeepSpeed 0.19.8 saves ep rank e's "
    "experts under mp rank e % tp but each rank loads its experts under its own mp rank, so rank 2 would "
    "look for layer_0_expert_0_mp_rank_02_model_states.pt, which no rank saves"
)
REFUSED = [  # (fixture, --to, error, sentence with {root} for the checkpoint's path)
    (
        "deepspeed/z1_fp16_w2",
        "tp=2,dp=2",
        UnsupportedError,
        "--to tp=2,dp=2: not supported yet for {root} (ep=... needs a mixture-of-experts checkpoint; give a "
        "world size to reshard its data-parallel ranks)",
    ),
    (
        "ds_tp/mpu_z2_fp32",
        "pp=2,tp=2,dp=1",
        UnsupportedError,
        "--to tp=2,pp=2: adding pipeline parallelism to the tensor-parallel checkpoint {root} is not "
        "supported yet (give tp=...,dp=... with pp=1)",
    ),
    (
        "ds_tp/mpu_z2_fp32",
        "3",
        UsageError,
        "--to 3: the source's tensor-parallel size 2 does not divide 3 ranks; give the new sizes, e.g. --to tp=1,dp=3",
    ),
    (
        "ds_tp/mpu_z2_fp32",
        "ep=2,tp=2,dp=2",
        UnsupportedError,
        "--to tp=2,ep=2,dp=2: {root} has no mixture-of-experts layers, so ep must be 1",
    ),
    (
        "ds_pp/pp2_dp2_z1_fp32",
        "tp=2,pp=2,dp=1",
        UnsupportedError,
        "--to tp=2,pp=2: adding tensor parallelism to the pipeline checkpoint {root} is not supported yet "
        "(give pp=...,dp=... with tp=1)"
        "; to add it, give --tp-rules FILE saying how the model built at that tp splits each parameter "
        "(the checkpoint, saved without tp, cannot say; see docs/tp_rules.md)",
    ),
    (
        "ds_3d/pp2_tp2_dp2_z1_fp32",
        "6",
        UsageError,
        "--to 6: the source's tp x pp = 2 x 2 does not divide 6 ranks; give the new sizes, e.g. --to tp=2,pp=1,dp=3",
    ),
    (
        "ds_moe/moe_z1_fp32_w2_k1",
        "ep=3,dp=3",
        UsageError,
        "--to ep=3,dp=3: MoE layer 'moe' has 4 experts, which 3 expert-parallel ranks cannot share equally "
        "(ep must divide every layer's expert count: [4])",
    ),
    (
        "ds_moe/moe_z1_fp32_w2_k1",
        "ep=2,dp=3",
        UsageError,
        "--to ep=2,dp=3: the expert-parallel size must divide the data-parallel world size (each "
        "expert-data-parallel group holds dp/ep ranks)",
    ),
    (
        "ds_moe/moe_z1_fp32_w2_k1",
        "tp=2,ep=2,dp=2",
        UnsupportedError,
        "--to tp=2,ep=2,dp=2: adding tensor parallelism to the mixture-of-experts checkpoint {root} is not "
        "supported yet (give ep=...,dp=... with tp=1,pp=1)"
        "; to add it, give --tp-rules FILE saying how the model built at that tp splits each parameter "
        "(the checkpoint, saved without tp, cannot say; see docs/tp_rules.md)",
    ),
    (
        "ds_moe_tp/moetp_z2_fp32_tp2_ep2_w4",
        "tp=2,ep=2,dp=3",
        UsageError,
        "--to tp=2,ep=2,dp=3: the expert-parallel size must divide the data-parallel size (each "
        "expert-data-parallel group holds dp/ep ranks of a tensor-parallel lane)",
    ),
    (
        "ds_moe_tp/moetp_noexptp_z2_fp32_tp2_ep2_w4",
        "3",
        UsageError,
        "--to 3: the source's tp 2 and ep 2 must both divide 3 ranks; give the new sizes, e.g. --to tp=1,ep=1,dp=3",
    ),
    ("ds_moe_tp/moetp_noexptp_z2_fp32_tp2_ep2_w4", "tp=4,ep=2,dp=1", UsageError, "--to tp=4,ep=2: " + WHOLE_TP_LOOKUP),
    (
        "ds_moe_tp/moetp_noexptp_z2_fp32_tp2_ep2_w4",
        "tp=2,ep=4,dp=1",
        UsageError,
        "--to tp=2,ep=4: the expert-parallel size must divide the 2 ranks (tp x dp: DeepSpeed groups experts "
        "over consecutive ranks when enable_expert_tensor_parallelism is False)",
    ),
    (
        "ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4",
        "pp=2,ep=2,dp=3",
        UsageError,
        "--to pp=2,ep=2,dp=3: the expert-parallel size must divide the data-parallel size (each "
        "expert-data-parallel group holds dp/ep ranks of a stage)",
    ),
    (
        "ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4",
        "tp=2,pp=2,ep=2,dp=2",
        UnsupportedError,
        "--to tp=2,pp=2,ep=2,dp=2: adding tensor parallelism to the mixture-of-experts PipelineModule "
        "checkpoint {root} is not supported yet (give pp=...,ep=...,dp=... with tp=1)",
    ),
    (
        "ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4",
        "3",
        UsageError,
        "--to 3: the source's pp x ep = 2 x 2 does not divide 3 ranks; give the new sizes, e.g. --to pp=1,ep=1,dp=3",
    ),
]


@pytest.mark.parametrize(("fixture", "to", "error", "sentence"), REFUSED)
def test_resized_refuses_sizes_the_writer_cannot_lay_out(fixture, to, error, sentence):
    if fixture not in FIXTURES:
        pytest.skip(f"fixture {fixture} not generated")
    index = _index(fixture)
    with pytest.raises(error) as refused:
        DeepSpeedLayout.of(index).resized(parse_parallel(to), index.root)
    assert str(refused.value) == sentence.format(root=index.root)
