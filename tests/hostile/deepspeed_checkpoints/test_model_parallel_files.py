"""Hostile model-parallel DeepSpeed checkpoints against the readers and writers: variants of
the real TP / pipeline / MoE / mesh fixtures, each run through the CLI and held to the error
contract (exit 2, one `error: ` sentence naming the file and the key, no traceback, no OUT left).

The variants, as an attacker or a careless user would make them, are crafted from copies of the
committed fixtures with torch's own pickle on the test side (trusted files we generated), as the other
hostile tests do.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers.corrupt import DATA, assert_error, run_cli

TAG = "global_step2"


def _edit(folder: Path, name: str, change: Callable[[dict], None]) -> None:
    path = folder / TAG / name
    obj = torch.load(path, weights_only=False)  # trusted: a copy of our own fixture
    change(obj)
    torch.save(obj, path)


def _tp_degree(value: int) -> Callable[[dict], None]:
    def change(obj: dict) -> None:
        obj["checkpoint_parallel_dimensions"]["tp_degree"] = value

    return change


def _tp_lost_ranks(folder: Path) -> None:
    """A 4-way TP checkpoint of which only mp ranks 0 and 1 were copied: the files say tp 4."""
    for name in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"):
        _edit(folder, name, _tp_degree(4))


def _recorded(key: str, value) -> Callable[[Path], None]:
    """Both mp ranks' universal_checkpoint_info[key] = value (AutoTP's record of its splits)."""

    def craft(folder: Path) -> None:
        for name in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"):
            _edit(folder, name, lambda obj: obj["universal_checkpoint_info"].__setitem__(key, value))

    return craft


def _remove(*names: str) -> Callable[[Path], None]:
    def craft(folder: Path) -> None:
        for name in names:
            (folder / TAG / name).unlink()

    return craft


def _copy_as(name: str, as_name: str) -> Callable[[Path], None]:
    def craft(folder: Path) -> None:
        shutil.copyfile(folder / TAG / name, folder / TAG / as_name)

    return craft


def _both_mp(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    """`change` on mp ranks 00 and 01's copy of the file `name` ({mp} for the rank)."""

    def craft(folder: Path) -> None:
        for mp in ("00", "01"):
            _edit(folder, name.format(mp=mp), change)

    return craft


def _expert_group_named(value: str) -> Callable[[dict], None]:
    def change(obj: dict) -> None:
        for group in obj["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]:
            if group.get("moe"):
                group["name"] = value

    return change


def _expert_weight_shape(obj: dict) -> None:
    key = next(k for k in obj if k.endswith("dense_h_to_4h.weight"))
    obj[key] = obj[key][:4].clone()


MOE_TP = "ds_moe_tp/moetp_z2_fp32_tp2_ep2_w4"
EXPERT_1 = "layer_0_expert_3_mp_rank_01_model_states.pt"


def _moved(name: str, as_name: str) -> Callable[[Path], None]:
    def craft(folder: Path) -> None:
        (folder / TAG / name).rename(folder / TAG / as_name)

    return craft


def _copied_changed(name: str, as_name: str) -> Callable[[Path], None]:
    """`name` also saved as `as_name`, its values changed (another copy of the expert, other bytes)."""

    def craft(folder: Path) -> None:
        shutil.copyfile(folder / TAG / name, folder / TAG / as_name)
        _edit(folder, as_name, lambda obj: [t.add_(1.0) for t in obj.values()])

    return craft


PP_MOE = "ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4"


def _swap_stages(folder: Path) -> None:
    """Every file of stage 0 renamed as stage 1's and back: layers 0-1 on stage 1, 2-3 on stage 0."""
    for path in sorted((folder / TAG).glob("*mp_rank_00*")):
        other = path.with_name(path.name.replace("mp_rank_00", "mp_rank_01"))
        path.rename(path.with_name("swap"))
        other.rename(path)
        path.with_name("swap").rename(other)


WHOLE = "ds_moe_tp/moetp_noexptp_z2_fp32_tp2_ep2_w4"
WHOLE_2 = "layer_0_expert_2_mp_rank_01_model_states.pt"
WHOLE_2_ON_0 = "layer_0_expert_2_mp_rank_00_model_states.pt"
Q_PROJ = r"^model\.layers\.0\.self_attn\.q_proj\.weight$"
AUTOTP = "ds_tp/autotp_z2_fp32"
UC = "universal_checkpoint_info"

# (id, fixture, crafting, command after SRC (OUT: the output folder), names the sentence must hold)
CASES = [
    (
        "tp-says-4-has-2",
        "ds_tp/mpu_z2_fp32",
        _tp_lost_ranks,
        ["consolidate", "SRC", "OUT"],
        ["mp_rank_00_model_states.pt", "tp_degree", "4", "2 mp ranks"],
    ),
    (
        "tp-says-4-has-2-reshard",
        "ds_tp/mpu_z2_fp32",
        _tp_lost_ranks,
        ["reshard", "SRC", "OUT", "--to", "tp=1,dp=2"],
        ["mp_rank_00_model_states.pt", "tp_degree"],
    ),
    (
        "tp-says-4-has-2-inspect",
        "ds_tp/autotp_z2_fp32",
        _tp_lost_ranks,
        ["inspect", "SRC"],
        ["mp_rank_00_model_states.pt", "tp_degree"],
    ),
    # universal_checkpoint_info's pattern lists: each could end in a TypeError / re.error (exit 3)
    # or, for a pattern that backtracks exponentially on a parameter name, run for hours
    (
        "uc-pattern-not-a-string",
        AUTOTP,
        _recorded("vocabulary_parameter_patterns", [123]),
        ["inspect", "SRC"],
        ["mp_rank_00_model_states.pt", UC, "vocabulary_parameter_patterns[0]", "pattern string"],
    ),
    (
        "uc-pattern-not-a-regex",
        AUTOTP,
        _recorded("vocabulary_parameter_patterns", ["("]),
        ["consolidate", "SRC", "OUT"],
        ["mp_rank_00_model_states.pt", "vocabulary_parameter_patterns[0]", "not a regular expression"],
    ),
    (
        "uc-patterns-a-string",
        AUTOTP,
        _recorded("vocabulary_parameter_patterns", "^lm_head"),
        ["inspect", "SRC"],
        ["mp_rank_00_model_states.pt", "vocabulary_parameter_patterns", "expected a list"],
    ),
    (
        "uc-patterns-an-int",
        AUTOTP,
        _recorded("tp_replicated_parameter_patterns", 5),
        ["inspect", "SRC"],
        ["mp_rank_00_model_states.pt", "tp_replicated_parameter_patterns", "expected a list"],
    ),
    (
        "uc-catastrophic-backtracking",
        AUTOTP,
        _recorded("tp_replicated_parameter_patterns", ["^([a-z_.0-9]+)+X$"]),
        ["consolidate", "SRC", "OUT"],
        ["mp_rank_00_model_states.pt", "tp_replicated_parameter_patterns[0]", "exponential"],
    ),
    (
        "uc-alternation-backtracking",
        AUTOTP,
        _recorded("parameter_with_row_parallelism_patterns", [r"(\w|\d)+X"]),
        ["inspect", "SRC"],
        ["mp_rank_00_model_states.pt", "parameter_with_row_parallelism_patterns[0]"],
    ),
    (
        "uc-sub-params-negative-dim",
        AUTOTP,
        _recorded("parameter_with_sub_params", [{"partition_dim": -1, "shape": [[8, 8], 16], "patterns": [Q_PROJ]}]),
        ["consolidate", "SRC", "OUT"],
        ["mp_rank_00_model_states.pt", "parameter_with_sub_params", "partition_dim"],
    ),
    (
        "uc-sub-params-sizes-not-ints",
        AUTOTP,
        _recorded("parameter_with_sub_params", [{"partition_dim": 0, "shape": [["a", "b"], 16], "patterns": [Q_PROJ]}]),
        ["inspect", "SRC"],
        ["mp_rank_00_model_states.pt", "parameter_with_sub_params"],
    ),
    (
        "uc-sub-params-zero-size",
        AUTOTP,
        _recorded("parameter_with_sub_params", [{"partition_dim": 0, "shape": [[0, 16], 16], "patterns": [Q_PROJ]}]),
        ["inspect", "SRC"],
        ["mp_rank_00_model_states.pt", "parameter_with_sub_params"],
    ),
    (
        "uc-sub-params-pattern-none",
        AUTOTP,
        _recorded("parameter_with_sub_params", [{"partition_dim": 0, "shape": [[8, 8], 16], "patterns": [None]}]),
        ["inspect", "SRC"],
        ["mp_rank_00_model_states.pt", "parameter_with_sub_params[0]: patterns[0]"],
    ),
    (
        "uc-unsupported-not-a-regex",
        AUTOTP,
        _recorded("autotp_unsupported_parameter_patterns", {"(": "x"}),
        ["reshard", "SRC", "OUT", "--to", "tp=1,dp=2"],
        ["mp_rank_00_model_states.pt", "autotp_unsupported_parameter_patterns"],
    ),
    # MoE with tensor parallelism: an mp rank's expert files lost, stray ones, sizes that lie
    (
        "moetp-expert-file-missing-on-mp-1",
        MOE_TP,
        _remove(EXPERT_1),
        ["consolidate", "SRC", "OUT"],
        [EXPERT_1, "expert file is missing", "4 experts"],
    ),
    (
        "moetp-expert-file-missing-reshard",
        MOE_TP,
        _remove(EXPERT_1),
        ["reshard", "SRC", "OUT", "--to", "tp=1,ep=2,dp=4"],
        [EXPERT_1, "expert file is missing"],
    ),
    (
        "moetp-no-expert-files-on-mp-1",
        MOE_TP,
        _remove(*[f"layer_0_expert_{e}_mp_rank_01_model_states.pt" for e in range(4)]),
        ["inspect", "SRC"],
        ["model-parallel rank(s) [1] have no expert files", "mp_rank_01"],
    ),
    (
        "moetp-stray-expert-of-mp-2",
        MOE_TP,
        _copy_as(EXPERT_1, "layer_0_expert_3_mp_rank_02_model_states.pt"),
        ["consolidate", "SRC", "OUT"],
        ["layer_0_expert_3_mp_rank_02_model_states.pt", "model-parallel rank 2", "rank(s) [0, 1] only"],
    ),
    (
        "moetp-says-tp-4",
        MOE_TP,
        _both_mp("mp_rank_{mp}_model_states.pt", _tp_degree(4)),
        ["reshard", "SRC", "OUT", "--to", "tp=1,ep=2,dp=4"],
        ["mp_rank_00_model_states.pt", "tp_degree", "2 mp ranks"],
    ),
    (
        "moetp-says-ep-4",
        MOE_TP,
        _both_mp("zero_pp_rank_0_mp_rank_{mp}_optim_states.pt", _expert_group_named("ep_size_4")),
        ["consolidate", "SRC", "OUT"],
        ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "expert-parallel size 4", "2 ranks"],
    ),
    (
        "moetp-expert-slice-shape-lies",
        MOE_TP,
        lambda f: _edit(f, EXPERT_1, _expert_weight_shape),
        ["consolidate", "SRC", "OUT"],
        [EXPERT_1, "dense_h_to_4h.weight", "[4, 8]", "[8, 8]"],
    ),
    # MoE + TP with whole experts (enable_expert_tensor_parallelism=False): mp rank t holds ep rank t's experts
    (
        "moetp-whole-expert-file-missing",
        WHOLE,
        _remove(WHOLE_2),
        ["consolidate", "SRC", "OUT"],
        [WHOLE_2, "expert file is missing", "4 experts"],
    ),
    (
        "moetp-whole-expert-on-another-mp-rank",
        WHOLE,
        _moved(WHOLE_2, WHOLE_2_ON_0),
        ["inspect", "SRC"],
        [WHOLE_2, "expert file is missing", "model-parallel rank 1", WHOLE_2_ON_0],
    ),
    # MoE inside a PipelineModule, resharded to a new pp: stages that the partition method does not give
    (
        "ppmoe-stages-swapped",
        PP_MOE,
        _swap_stages,
        ["reshard", "SRC", "OUT", "--to", "pp=1,ep=2,dp=2"],
        ["do not split into its 2 stages", "layer 0 is on stage 1", "--partition-method parameters"],
    ),
    (
        "ppmoe-stages-swapped-same-pp",
        PP_MOE,
        _swap_stages,
        ["reshard", "SRC", "OUT", "--to", "pp=2,ep=1,dp=2"],
        ["pipeline stage 0 holds layer 3", "stage 1's layer 0", "in order"],
    ),
    (
        "ppmoe-layer-types-too-few",
        PP_MOE,
        lambda f: None,
        ["reshard", "SRC", "OUT", "--to", "pp=1,ep=2,dp=2", "--layer-types", "Embed,MoEBlock"],
        ["--layer-types names 2 layers", "layer 3"],
    ),
    (
        "ppmoe-type-method-without-layer-types",
        PP_MOE,
        lambda f: None,
        ["reshard", "SRC", "OUT", "--to", "pp=1,ep=2,dp=2", "--partition-method", "type:MoE"],
        ["type:MoE", "--layer-types"],
    ),
    (
        "ppmoe-expert-of-the-other-stages-layer",
        PP_MOE,
        _copy_as("layer_0_expert_0_mp_rank_00_model_states.pt", "layer_0_expert_0_mp_rank_01_model_states.pt"),
        ["reshard", "SRC", "OUT", "--to", "pp=1,ep=2,dp=2"],
        ["layer_0_expert_0_mp_rank_01_model_states.pt", "2.moe.deepspeed_moe.experts.deepspeed_experts.0.fc1.weight"],
    ),
    (
        "moetp-whole-expert-on-two-mp-ranks",
        WHOLE,
        _copied_changed(WHOLE_2, WHOLE_2_ON_0),
        ["reshard", "SRC", "OUT", "--to", "4"],
        [WHOLE_2_ON_0, "expert 2", "ranks [0, 1]", "exactly one"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_model_parallel_input_is_one_sentence(tmp_path: Path, case) -> None:
    _, fixture, craft, command, names = case
    if not (DATA / fixture).is_dir():
        pytest.skip(f"fixture {fixture} not generated")
    src = tmp_path / "src"
    shutil.copytree(DATA / fixture, src)
    craft(src)
    out = tmp_path / "out"
    args = [str(src) if a == "SRC" else str(out) if a == "OUT" else a for a in command]
    res = run_cli(*args)
    assert_error(res, *names, out=out)


PIPELINE = "ds_pp/pp2_dp2_z1_fp32"
MANY = '{"rules": [' + ",".join(f'{{"pattern": "zz{i}", "split": 0}}' for i in range(100_001)) + "]}"

# --tp-rules FILE contents a careless user writes: (id, file name, text, names the sentence must hold)
RULES = [
    (
        "nested-repetition",
        "rules.json",
        '{"rules": [{"pattern": "re:([a-z_.]+)+X", "split": 0}]}',
        ["rules.json", "rule 0", "exponential"],
    ),
    (
        "fused-parts-do-not-sum",
        "rules.json",
        '{"rules": [{"pattern": "*", "fused": [3, 3]}]}',
        ["tied_modules.embed.weight", "[3, 3]", "11"],
    ),
    (
        "fused-count-does-not-divide",
        "rules.toml",
        '[[rules]]\npattern = "*"\nfused = 1000000000\n',
        ["tied_modules.embed.weight", "1000000000 equal blocks"],
    ),
    ("too-many-rules", "rules.json", MANY, ["rules.json", "100001 rules"]),
    (
        "toml-nested-too-deeply",
        "rules.toml",
        "a = " + "[" * 5000 + "]" * 5000 + "\n",  # tomllib recursed
        ["rules.toml", "nested too deeply"],
    ),
    ("not-toml", "rules.toml", 'rules:\n  - ["*", 0]\n', ["rules.toml", "not valid TOML"]),
]


@pytest.mark.parametrize("case", RULES, ids=[c[0] for c in RULES])
def test_hostile_tp_rules_file_is_one_sentence(tmp_path: Path, case) -> None:
    """Unchecked, each would be accepted (the fused ones silently, the others after minutes to
    hours of matching): refused before anything is written."""
    _, file_name, text, names = case
    if not (DATA / PIPELINE).is_dir():
        pytest.skip(f"fixture {PIPELINE} not generated")
    rules = tmp_path / file_name
    rules.write_text(text)
    out = tmp_path / "out"
    res = run_cli(
        "convert",
        str(DATA / PIPELINE),
        str(out),
        "--to",
        "dcp",
        "--world-size",
        "mesh=dp_shard:2,tp:2",
        "--tp-rules",
        str(rules),
    )
    assert res.exception is None and "Traceback" not in res.output, res.output
    assert res.code == 2, res.output
    for name in names:
        assert name in res.output, f"{name!r} not in {res.output}"
    assert not out.exists()
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output  # not click's usage form


def test_layout_on_a_mesh_of_many_ranks_is_linear_in_ranks() -> None:
    """Finding each rank's box by building every rank's torch.chunk piece (ranks x ranks per tensor
    shape) is quadratic: reshard --to mesh=dp_shard:4096,tp:2 of a 4-rank fixture took 83 s that way,
    one of dp_shard:8192 more than 2 minutes, and 2^20 ranks (within the rank cap) would run for days."""
    import time

    from ckptkit.index.mesh import Placement, rank_boxes
    from ckptkit.index.parallel_spec import parse_parallel

    mesh = parse_parallel("mesh=dp_shard:32768,tp:2")
    start = time.monotonic()
    rows = rank_boxes((64, 16), mesh, Placement(True, 0))  # _StridedShard on dp_shard, tp on dim 0
    cols = rank_boxes((64, 16), mesh, Placement(True, 1))
    assert time.monotonic() - start < 30
    assert len(rows) == len(cols) == 65536
    assert rows[0].sizes == (1, 16) and rows[-1].sizes == (0, 16)  # 64 rows over 65536 ranks: most empty
    assert cols[1].offsets == (0, 8) and cols[1].sizes == (1, 8)
    assert sum(b.sizes[0] for b in rows) == 64  # tp and dp_shard both cut dim 0: each row once


@pytest.mark.parametrize("damage", ["overlap", "gap"])
def test_mesh_reshard_of_a_source_with_broken_chunks_names_the_tensor(tmp_path: Path, damage: str) -> None:
    """A 2-D DCP source whose chunks overlap or leave a gap fits no mesh; reshard --to mesh=... used
    to blame a missing tensor-parallel split rule ("write a rule for embed.weight") instead."""
    import dataclasses

    from helpers.corrupt import load_md, save_md

    fixture = DATA / "mesh" / "fsdp_tp_d2t2"
    if not fixture.is_dir():
        pytest.skip("mesh fixtures not generated")
    src = tmp_path / "src"
    shutil.copytree(fixture, src)
    md = load_md(src)
    chunks = md.state_dict_metadata["model.embed.weight"].chunks
    if damage == "overlap":
        chunks[1] = dataclasses.replace(chunks[1], offsets=torch.Size(chunks[0].offsets))
    else:
        del chunks[1]
    save_md(src, md)
    for command in (
        ["reshard", "--to", "mesh=dp_shard:2,tp:2"],
        ["convert", "--to", "dcp", "--world-size", "mesh=dp_shard:4,tp:2"],
    ):
        out = tmp_path / f"out_{command[0]}"
        res = run_cli(command[0], str(src), str(out), *command[1:])
        assert_error(res, "model.embed.weight", "not tiled exactly", out=out)
        assert "split rule" not in res.output


@pytest.mark.parametrize("command", [["reshard", "--to"], ["convert", "--to", "dcp", "--world-size"]])
def test_a_mesh_beyond_the_stated_bound_is_refused_before_any_work(tmp_path: Path, command) -> None:
    """131,072 ranks (within the 2^20-rank cap) would lay out for minutes in GBs (2^20: ~25 min,
    ~12 GB): a mesh over MAX_MESH_RANKS is refused in one sentence, nothing written."""
    from ckptkit.index.parallel_spec import MAX_MESH_RANKS

    fixture = DATA / "mesh" / "fsdp_tp_d2t2"
    if not fixture.is_dir():
        pytest.skip("mesh fixtures not generated")
    out = tmp_path / "out"
    mesh = f"mesh=dp_shard:{MAX_MESH_RANKS},tp:2"
    res = run_cli(command[0], str(fixture), str(out), *command[1:], mesh)
    assert_error(res, mesh, str(2 * MAX_MESH_RANKS), f"at most {MAX_MESH_RANKS} ranks", out=out)


@pytest.mark.parametrize("fixture,to", [("ds_tp/mpu_z2_fp32", "tp=1,dp=1000000"), ("deepspeed/z2_fp32_w2", "1000000")])
def test_a_deepspeed_target_beyond_the_stated_bound_is_refused(tmp_path: Path, fixture: str, to: str) -> None:
    """--to 1000000 is within the 2^20-rank cap but the DeepSpeed writers grow with the ranks (16,384
    ranks: 45 s, 440 MB; 10^6: ~50 min, ~28 GB); over MAX_DEEPSPEED_RANKS it is refused up front."""
    if not (DATA / fixture).is_dir():
        pytest.skip(f"fixture {fixture} not generated")
    out = tmp_path / "out"
    res = run_cli("reshard", str(DATA / fixture), str(out), "--to", to)
    assert_error(res, f"--to {to.split(',')[-1]}", "1000000 ranks", "at most 65536", out=out)


def test_convert_to_zero_beyond_the_stated_bound_is_refused(tmp_path: Path) -> None:
    """convert --to zero2 --world-size 1000000: the same ZeRO writer, the same bound."""
    fixture = DATA / "deepspeed" / "z2_fp32_w2"
    if not fixture.is_dir():
        pytest.skip("DeepSpeed fixtures not generated")
    out = tmp_path / "out"
    res = run_cli("convert", str(fixture), str(out), "--to", "zero2", "--world-size", "1000000")
    assert_error(res, "--world-size 1000000", "at most 65536", out=out)
