"""DeepSpeed's own engine loads what reshard writes: one matrix of fixture x target sizes over the
layouts (ZeRO 1/2/3 at a new world size, with DeepSpeed's Adam or another optimizer; tensor
parallel, Megatron-style and AutoTP cut unevenly, at a new tp and dp; mixture of experts at a new
ep and dp; experts under tensor parallelism, sliced or whole, at a new tp, ep and dp; pipeline
stages at a new pp and dp, DeepSpeed's PipelineModule partitioning the layers as reshard did; a
pipeline of experts at a new pp, ep and dp; pp x tp x dp joined into tp; a MoE source saved
without tp grown into tp with --tp-rules), and what convert --to ds-universal writes, loaded
with "load_universal" at a data-parallel size the source was not saved at (DeepSpeed's AutoTP
cutting each whole tensor again for a tp source).

For each case ckptkit reshards (or converts) the fixture to the target; DeepSpeed builds the model
at the target sizes (its weights scrambled first, so nothing passes by accident),
engine.load_checkpoint()s the output, and every master weight, Adam moment, module weight (and the
layout's steps, buffers, frozen and client state) read back through DeepSpeed's own safe_get_full_*
APIs must equal the fixture's truth bit for bit (for another optimizer: every key of its state);
then the engine trains a step. The checks are tests/dist's ds_load_check.py (ZeRO),
ds_tp_load_check.py, ds_moe_load_check.py, ds_moe_tp_load_check.py, ds_pp_reshard_check.py,
ds_pp_moe_load_check.py, ds_3d_load_check.py, ds_universal_load_check.py and
ds_tp_universal_load_check.py (a universal load restores no module state: those scripts say what
they compare). Where DeepSpeed saves what it loaded (--save), its files must equal ours object for
object.

DeepSpeed's start-up on CPU costs most of a check, so the cases of one target world size run in one
launch (tests/dist/ds_engine_cases.py, which forgets the groups DeepSpeed keeps between engines), in
the order of the matrix: the tensor-parallel cases last, as AutoTP's mode stays set for the engines
after it. Each test asserts its own case's result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptkit.formats.deepspeed import pipeline_partition
from ckptkit.ops.convert import convert
from ckptkit.ops.reshard import reshard
from conftest import DATA, ROOT
from helpers.convert_truth import dm, ds_truth_from_torch
from helpers.ds_engine_jobs import run_engine_cases
from helpers.ds_fixtures import DS_DATA, assert_same_pickled, needs_deepspeed

pytestmark = [pytest.mark.slow, needs_deepspeed]

OPT_DATA = DATA / "deepspeed_optimizers"
OPT_FIXTURES = sorted(p.name for p in OPT_DATA.iterdir() if p.is_dir()) if OPT_DATA.is_dir() else []


@dataclass(frozen=True)
class EngineCase:
    layout: str  # a key of LAYOUTS
    fixture: str
    to: str  # reshard --to
    world: int  # the launch's world size
    size: int = 1  # tp (tensor parallel) or ep (mixture of experts) the model is built at
    ep: int = 1  # experts under tensor parallelism: the ep (size is the tp)
    rules: str | None = None  # reshard's --tp-rules (adding tp to a source saved without it)
    method: str = "uniform"  # pipeline stages: the --partition-method (size is the pp)
    pp: int = 1  # a pipeline of experts or a 3-D layout: the pp (size is its ep or tp)
    save: bool = False  # DeepSpeed saves what it loaded next to the output ("<output>-saved")
    model: str = ""  # an FSDP2 source: the DeepSpeed fixture whose model and ds_config the engine uses

    @property
    def id(self) -> str:
        return f"{self.layout}-{self.fixture}-to-{self.to}"

    @property
    def source(self) -> Path:
        return LAYOUTS[self.layout][0] / self.fixture

    def argv(self, out: Path) -> list[str]:
        """The check script's options (tests/dist/<check>.py) for the reshard in `out`."""
        base = ["--ckpt", str(out), "--fixture", self.fixture]
        if self.layout == "from_fsdp2":  # the truth and ds_config write() put next to the output
            return [
                "--ckpt",
                str(out),
                "--fixture",
                self.model,
                "--truth",
                f"{out}-truth.pt",
                "--ds-config",
                f"{out}.json",
            ]
        if self.layout in ("zero", "zero_optim"):
            return [*base, "--truth", str(self.source.parent / f"{self.fixture}.truth.pt")]
        if self.layout == "zero_via_dcp":  # loaded with the fixture's own optimizer (its ds_config)
            truth = str(self.source.parent / f"{self.fixture}.truth.pt")
            return [*base, "--truth", truth, "--ds-config", str(self.source / "ds_config.json")]
        if self.layout in ("moe_tp", "moe_tp_grown"):
            whole = ["--whole-experts"] if "noexptp" in self.fixture else []
            truth = ["--truth", str(self.source.parent / f"{self.fixture}.truth.pt")]
            return [*base, "--tp", str(self.size), "--ep", str(self.ep), *whole, *truth]
        if self.layout == "pp":
            return [*base, "--pp", str(self.size), "--partition-method", self.method]
        if self.layout == "pp_moe":
            save = ["--save", f"{out}-saved"] if self.save else []
            return [*base, "--pp", str(self.pp), "--ep", str(self.size), *save]
        if self.layout == "3d":
            return [*base, "--tp", str(self.size), "--pp", str(self.pp)]
        if self.layout == "3d_grown":
            truth = str(self.source.parent / f"{self.fixture}.truth.pt")
            return [*base, "--tp", str(self.size), "--pp", str(self.pp), "--truth", truth]
        if self.layout == "universal":
            truth = str(self.source.parent / f"{self.fixture}.truth.pt")
            return [*base, "--truth", truth, "--tag", "global_step2_universal"]
        return [*base, "--ep" if self.layout == "moe" else "--tp", str(self.size)]

    def write(self, out: Path) -> None:
        """ckptkit's reshard of the fixture to the target into `out` (pipeline stages: with the
        case's --partition-method, and the layer types a type: method weighs), or its convert
        --to ds-universal."""
        if self.to == "ds-universal":
            convert(str(self.source), str(out), "ds-universal")
            return
        if self.layout == "from_fsdp2":
            self.write_from_fsdp2(out)
            return
        if self.layout == "zero_via_dcp":  # ZeRO -> DCP at 2 -> ZeRO of the fixture's stage at the target
            dcp = out.with_name(f"{out.name}-dcp")
            convert(str(self.source), str(dcp), "dcp", world_size=2)
            config = str(self.source / "ds_config.json")
            convert(str(dcp), str(out), f"zero{self.fixture[1]}", world_size=int(self.to), ds_config=config)
            return
        pipeline_partition.use_partition_method(self.method if self.layout in ("pp", "3d", "3d_grown") else None)
        pipeline_partition.use_layer_types(LAYER_TYPES if self.method.startswith("type:") else None)
        try:
            reshard(str(self.source), str(out), self.to, tp_rules=self.rules)
        finally:
            pipeline_partition.use_partition_method(None)
            pipeline_partition.use_layer_types(None)

    def write_from_fsdp2(self, out: Path) -> None:
        """convert of the FSDP2 source to ZeRO at the target world size with the model fixture's
        ds_config at that size ("<out>.json"), and DeepSpeed's truth made from torch's ("<out>-truth.pt")."""
        import torch

        config = dm.with_world_size(json.loads((DS_DATA / self.model / "ds_config.json").read_text()), self.world)
        Path(f"{out}.json").write_text(json.dumps(config))
        convert(str(self.source), str(out), self.to, world_size=self.world, ds_config=f"{out}.json")
        start = torch.load(self.source.parent / f"{self.fixture}.truth.pt", weights_only=True)
        truth = ds_truth_from_torch(start, config, {"extra": {"epoch": 3, "note": "hello"}})
        torch.save(truth, f"{out}-truth.pt")


# layout -> (its fixtures' folder, the check of tests/dist that loads it)
LAYOUTS = {
    "zero": (DS_DATA, "ds_load_check"),
    "zero_optim": (OPT_DATA, "ds_load_check"),
    "zero_via_dcp": (OPT_DATA, "ds_load_check"),
    "moe": (DATA / "ds_moe", "ds_moe_load_check"),
    "tp": (DATA / "ds_tp", "ds_tp_load_check"),
    "tp_uneven": (DATA / "ds_tp_uneven", "ds_tp_load_check"),
    "moe_tp": (DATA / "ds_moe_tp", "ds_moe_tp_load_check"),
    "pp": (DATA / "ds_pp", "ds_pp_reshard_check"),
    "pp_moe": (DATA / "ds_pp_moe", "ds_pp_moe_load_check"),
    "3d": (DATA / "ds_3d", "ds_3d_load_check"),
    "moe_tp_grown": (DATA / "ds_grow_tp" / "moe", "ds_moe_tp_load_check"),
    "universal": (DS_DATA, "ds_universal_load_check"),
    "tp_universal": (DATA / "ds_tp", "ds_tp_universal_load_check"),
    "from_fsdp2": (DATA / "convert", "ds_load_check"),
    "3d_grown": (DATA / "ds_grow_tp" / "pp", "ds_3d_load_check"),
}
GROW_RULES = str(ROOT / "docs" / "tp_rules.grow.json")
# the pipeline "type" fixture's partition_method and its layers' class names (fixtures/generate_ds_pp.py
# TYPE_METHOD, LAYER_TYPES): FrozenBlock and LayerNorm weigh 1, stages [0, 4, 6] at pp 2
TYPE = "type:layernorm|frozen"
LAYER_TYPES = "Embed,Block,FrozenBlock,Block,LayerNorm,Embed"

MATRIX = [
    # ZeRO 1/2/3 in fp16, bf16 and fp32 (sub-groups too), grown and shrunk
    *(EngineCase("zero", name, "3", 3) for name in ("z1_fp16_w2", "z3_bf16_w2", "z2_fp32_w2")),
    *(EngineCase("zero", name, "2", 2) for name in ("z2_bf16_w4", "z3_fp32_w3_subgroups", "z1_fp16_w3")),
    *(EngineCase("zero", name, "4", 4) for name in ("z3_fp16_w2", "z1_bf16_w2")),
    # torch's AdamW, SGD, Adagrad, RMSprop (fixtures/data/deepspeed_optimizers): each 2 -> 3
    *(EngineCase("zero_optim", name, "3", 3) for name in OPT_FIXTURES),
    # DeepSpeed's SGD, RMSprop, Adagrad, client AdamW and torch_adam AdamW converted to DCP at 2 and
    # back to ZeRO at 3 (to: the world size), loaded with the fixture's own optimizer
    *(
        EngineCase("zero_via_dcp", name, "3", 3)
        for name in (
            "z2_sgd_fp32_w2",
            "z3_rmsprop_bf16_w2",
            "z1_adagrad_fp32_w2",
            "z2_clientadamw_bf16_w2",
            "z3_torchadamw_fp32_w2",
        )
    ),
    # universal checkpoints of ZeRO 2 bf16 and ZeRO 3 fp32, loaded at 3 ranks (saved at 2)
    *(EngineCase("universal", name, "ds-universal", 3) for name in ("z2_bf16_w2", "z3_fp32_w2")),
    # FSDP2 runs (tests/convert/test_convert_frameworks.py) converted to ZeRO 3 bf16 at 2 ranks (saved at 3)
    # and to ZeRO 2 fp32 at 3 (saved at 2, tied weights)
    EngineCase("from_fsdp2", "fsdp2ds_w3", "zero3", 2, model="z3_bf16_w2"),
    EngineCase("from_fsdp2", "fsdp2ds_w2", "zero2", 3, model="z2_fp32_w2"),
    # experts: spread over more ranks, gathered onto fewer, a second MoE layer, top-2 gating in bf16
    EngineCase("moe", "moe_z2_fp32_w4_k1", "ep=2,dp=2", 2, size=2),
    EngineCase("moe", "moe2_z2_fp32_w2_k1", "ep=1,dp=2", 2, size=1),
    EngineCase("moe", "moe_z1_fp32_w2_k1", "ep=4,dp=4", 4, size=4),
    EngineCase("moe", "moe_z2_bf16_w2_k2", "ep=4,dp=4", 4, size=4),
    # pipeline stages: fp32 pp 2 x dp 2 -> pp 4 by parameters (layers [0, 1, 3, 5, 6]: a stage holding
    # only the tied embedding, another only the tied head); bf16 pp 2 x dp 2 -> one stage over 2
    # ranks (both tied layers on one stage); the fixture DeepSpeed wrote with a type: method
    # (stages [0, 4, 6]) -> pp 3, whose PipelineModule builds [0, 4, 5, 6]
    EngineCase("pp", "pp2_dp2_z1_fp32", "pp=4,dp=1", 4, size=4, method="parameters"),
    EngineCase("pp", "pp2_dp2_z1_bf16", "pp=1,dp=2", 2, size=1),
    EngineCase("pp", "pp2_dp1_z1_fp32_type", "pp=3,dp=1", 3, size=3, method=TYPE),
    # a pipeline of experts: pp 2 -> 1 (DeepSpeed then saves it: its files equal ours), ep 2 -> 1
    EngineCase("pp_moe", "ppmoe_z1_fp32_pp2_ep2_w4", "pp=1,ep=2,dp=2", 2, size=2, pp=1, save=True),
    EngineCase("pp_moe", "ppmoe_z1_fp32_pp2_ep2_w4", "pp=2,ep=1,dp=2", 4, size=1, pp=2),
    # Megatron-style tp joined into one rank and split over four (ZeRO 3)
    EngineCase("tp", "mpu_z1_bf16", "tp=1,dp=2", 2, size=1),
    EngineCase("tp", "mpu_z3_fp32", "tp=4,dp=1", 4, size=4),
    # experts sliced over tp: tp 2 -> 4, ep 2 -> 1; whole experts: tp 2 -> 4, ep 2 -> 4 (dp 2 -> 1)
    EngineCase("moe_tp", "moetp_z2_fp32_tp2_ep2_w4", "tp=4,ep=1,dp=1", 4, size=4, ep=1),
    EngineCase("moe_tp", "moetp_noexptp_z2_fp32_tp2_ep2_w4", "tp=4,ep=4,dp=1", 4, size=4, ep=4),
    # a MoE source saved at tp 1, ep 2 grown into tp 4 (ep 1) by docs/tp_rules.grow.json
    EngineCase("moe_tp_grown", "moetp_z2_fp32_tp1_ep2_w2", "tp=4,ep=1,dp=1", 4, size=4, ep=1, rules=GROW_RULES),
    # pp 2 x tp 2 x dp 2 joined into tp 4 (other targets loaded by hand: docs/formats/deepspeed.md)
    EngineCase("3d", "pp2_tp2_dp2_z1_fp32", "tp=4,pp=1,dp=1", 4, size=4, pp=1),
    # a pipeline saved at tp 1 (pp 2 x dp 2) grown into tp 2 x pp 2 by docs/tp_rules.grow.json
    EngineCase("3d_grown", "pp2_tp1_dp2_z1_fp32", "tp=2,pp=2,dp=1", 4, size=2, pp=2, rules=GROW_RULES),
    # AutoTP's uneven cut at tp 3, and a grain-size cut joined into one rank
    EngineCase("tp_uneven", "autotp_odd_z1_fp32", "tp=3,dp=1", 3, size=3),
    EngineCase("tp_uneven", "autotp_grain_z1_fp32", "tp=1,dp=2", 2, size=1),
    # AutoTP saved at tp 2 x dp 2, universal, loaded at tp 2 x dp 1 (AutoTP cutting it again)
    EngineCase("tp_universal", "autotp_z1_bf16", "ds-universal", 2, size=2),
]


def _experts(name: str) -> int:
    info = json.loads((LAYOUTS["moe"][0] / name / "fixture.json").read_text())
    return info["num_experts"] + (info.get("second_moe_experts") or 0)


def _least_compared(case: EngineCase) -> int:
    """How many values the check must have compared for the case to count (all ranks together)."""
    if case.layout == "zero_optim":  # every state key of every parameter, masters, frozen, buffers, counters
        import torch

        truth = torch.load(case.source.parent / f"{case.fixture}.truth.pt", weights_only=True)
        return sum(1 for k in truth if k.startswith("state.")) + 9
    if case.layout == "moe_tp_grown":  # 12 dense + all 4 experts' 4 at ep 1: 4 values each on every rank
        return 4 * 28 * case.world
    if case.layout == "moe_tp":  # master, 2 moments and module weight of each parameter on every rank:
        per_rank = 16 if "noexptp" in case.fixture else 28  # 12 dense + 1 local expert of 4, or all 28
        return 4 * per_rank * case.world
    if case.layout == "pp":  # per rank, 5 values of each trainable parameter of its stage, frozen, buffers
        return 5 * 13
    if case.layout == "pp_moe":  # every parameter of each rank's stage (how many: the stage's)
        return 1
    if case.layout == "zero_via_dcp":  # every state key of every parameter and the training state
        return 40
    if case.layout == "universal":  # what a universal load restores (ds_universal_load_check.py)
        return 40
    if case.layout == "tp_universal":
        return 90
    if case.layout == "tp":  # 15 parameters: master, 2 moments and module weight on every rank
        return 4 * 15 * case.world
    if case.layout == "tp_uneven":  # 12 parameters, the same 4 values each on every rank
        return 4 * 12 * case.world
    if case.layout == "moe":  # 4 per expert: master, 2 moments, step and module weight, plus the dense ones
        return 5 * 4 * _experts(case.fixture)
    return 50


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory):
    """world size -> {case id: result}: the reshards of that size's cases (fixtures present),
    checked in one launch the first time a test asks."""
    done: dict[int, dict[str, dict]] = {}

    def results(world: int) -> dict[str, dict]:
        if world not in done:
            folder = tmp_path_factory.mktemp(f"engine_w{world}")
            cases, refused = [], {}
            for case in (c for c in MATRIX if c.world == world and c.source.is_dir()):
                out = folder / case.id
                try:
                    case.write(out)
                except Exception as exc:  # this case's test fails with it; the others still run
                    refused[case.id] = {"ok": False, "error": f"--to {case.to}: {exc}"}
                    continue
                cases.append({"id": case.id, "check": LAYOUTS[case.layout][1], "argv": case.argv(out)})
            done[world] = {**run_engine_cases(world, cases, folder), **refused}
            for case in cases:  # where its output is (a case whose engine saved compares the two)
                done[world][case["id"]]["output"] = str(folder / case["id"])
        return done[world]

    return results


def _assert_pipeline(r: dict, case: EngineCase) -> None:
    """ds_pp_reshard_check.py's result: every rank's outcome."""
    assert r["ok"], [{k: p.get(k) for k in ("error", "mismatches")} for p in r.get("ranks", [])] or r
    assert r["world_size"] == case.world and r["pp"] == case.size and r["compared"] >= _least_compared(case), r
    assert all(p.get("trained_step") for p in r["ranks"]), r
    if case.method == TYPE:  # DeepSpeed's own stages at pp 3 are the ones the output was laid out for
        assert all(p["parts"] == [0, 4, 5, 6] for p in r["ranks"]), [p["parts"] for p in r["ranks"]]


def _assert_3d(r: dict, case: EngineCase) -> None:
    """ds_3d_load_check.py's result: every rank's outcome, each holding all 28 parameters at pp 1
    (fp32, module, exp_avg, exp_avg_sq and step each)."""
    ranks = r.get("ranks")
    assert ranks, r
    assert not [p.get("error") for p in ranks if p.get("error")], ranks
    assert not [m for p in ranks for m in p["mismatches"]]
    assert [p["compared"] for p in ranks] == [5 * 28] * case.world
    assert {p["global_steps"] for p in ranks} == {2} and all(p["loss_finite"] for p in ranks)


def _assert_3d_grown(r: dict, case: EngineCase) -> None:
    """ds_3d_load_check.py's result for a grown pipeline: every rank loaded, compared its slice of
    the truth with no mismatch, and trained a finite step."""
    ranks = r.get("ranks")
    assert ranks and [p.get("error") for p in ranks] == [None] * case.world, ranks or r
    assert all(not p["mismatches"] and p["compared"] > 0 and p["loss_finite"] for p in ranks), ranks
    assert {p["global_steps"] for p in ranks} == {2}


def _assert_saved_equals_ours(r: dict) -> None:
    """What DeepSpeed saved after loading our output (its own files at these sizes) equals our output
    object for object (DeepSpeed's own pickles: fragment_address, ZeroStageEnum)."""
    import torch

    ours = Path(r["output"]) / "global_step2"
    theirs = Path(f"{r['output']}-saved") / "global_step2"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for f in sorted(theirs.iterdir()):
        assert_same_pickled(torch.load(f, weights_only=False), torch.load(ours / f.name, weights_only=False), f.name)


def _assert_engine(r: dict, case: EngineCase) -> None:
    """The result of the other checks: the verdict, its sizes and how much it compared."""
    assert r["ok"], {k: r.get(k) for k in ("error", "mismatches", "traceback")}
    assert r["world_size"] == case.world and r["trained_step"], r
    if case.layout in ("tp", "tp_uneven", "moe_tp", "moe_tp_grown"):
        assert r["tp"] == case.size and r["compared"] == _least_compared(case), r
    elif case.layout == "tp_universal":
        assert r["tp"] == case.size and r["compared"] >= _least_compared(case), r
    else:
        assert r["compared"] >= _least_compared(case), r
    if case.layout in ("zero", "zero_optim", "zero_via_dcp", "moe", "universal"):
        assert r["fixture"] == case.fixture, r
    if case.layout == "from_fsdp2":
        assert r["fixture"] == case.model, r
    if case.layout in ("moe", "pp_moe"):
        assert r["ep"] == case.size, r
    if case.layout == "pp_moe":
        assert r["pp"] == case.pp, r
    if case.save:
        _assert_saved_equals_ours(r)


@pytest.mark.parametrize("case", MATRIX, ids=[c.id for c in MATRIX])
def test_deepspeed_loads_the_reshard_bit_for_bit_and_trains(engine_results, case):
    if not case.source.is_dir():
        pytest.skip(f"fixture {case.source} not generated (fixtures/generate_*.py)")
    r = engine_results(case.world)[case.id]
    if case.layout == "pp":
        _assert_pipeline(r, case)
    elif case.layout == "3d":
        _assert_3d(r, case)
    elif case.layout == "3d_grown":
        _assert_3d_grown(r, case)
    else:
        _assert_engine(r, case)
