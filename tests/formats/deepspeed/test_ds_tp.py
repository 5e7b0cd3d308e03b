"""Tensor-parallel DeepSpeed checkpoints (fixtures/data/ds_tp/, written by fixtures/generate_ds_tp.py:
real DeepSpeed runs at tp=2 x dp=2 on CPU) are read into full tensors equal, bit for bit, to what
DeepSpeed's own safe_get_full_fp32_param / safe_get_full_optimizer_state give on each tp rank,
assembled along the split the model defines. Consolidate, convert, verify, diff, plan and inspect
work on them; reshard refuses them by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

DATA = Path(__file__).resolve().parents[3] / "fixtures" / "data" / "ds_tp"
VERSIONS = json.loads((DATA / "VERSIONS.json").read_text()) if (DATA / "VERSIONS.json").exists() else {}
FIXTURES = sorted(VERSIONS.get("fixtures", {}))
MPU = [n for n in FIXTURES if VERSIONS["fixtures"][n]["kind"] == "mpu"]
AUTOTP = [n for n in FIXTURES if VERSIONS["fixtures"][n]["kind"] == "autotp"]
KEY_OF = {
    "fp32": "model.{}",
    "exp_avg": "optim.state.{}.exp_avg",
    "exp_avg_sq": "optim.state.{}.exp_avg_sq",
    "module": "ds_module.{}",
}

pytestmark = pytest.mark.skipif(
    not FIXTURES, reason="fixtures/data/ds_tp/ not generated (python fixtures/generate_ds_tp.py)"
)


def _truth(name: str) -> dict:
    return torch.load(DATA / f"{name}.truth.pt", weights_only=False)


def _full_tensors(truth: dict) -> dict[str, tuple[str, torch.Tensor]]:
    """index key -> (parameter, full tensor) for every full tensor the truth holds."""
    out = {}
    for k, v in truth.items():
        kind, _, param = k.partition(".")
        if kind in KEY_OF and isinstance(v, torch.Tensor):
            out[KEY_OF[kind].format(param)] = (param, v)
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_full_tensors_are_deepspeeds_bit_for_bit(name):
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.index.types import Box
    from ckptkit.runner.fetch import Fetcher

    opened = open_checkpoint(str(DATA / name))
    index = opened.index
    truth = _truth(name)
    assert index.metadata["parallel"] == {"tp": VERSIONS["tp"], "dp": VERSIONS["world_size"] // VERSIONS["tp"]}
    fetcher = Fetcher(opened.source, index=index)
    full = _full_tensors(truth)
    assert full
    stage = index.metadata["deepspeed"]["stage"]
    for key, (param, want) in full.items():
        if stage == 3 and key.startswith("ds_module."):  # ZeRO-3 saves placeholders, the reader skips them
            assert key not in index.tensors
            continue
        entry = index.tensors[key]
        got = fetcher.fetch(entry, Box.whole(entry.shape))
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(
            got.view(torch.uint8) if got.numel() else got, want.contiguous().view(torch.uint8) if want.numel() else want
        ), key
        split = truth[f"split.{param}"]
        tp = entry.attrs["parallel"]["tp"]
        assert tp["size"] == VERSIONS["tp"]
        assert tp["dim"] == (None if split[0] == "replicated" else split[1]), key
        assert tp.get("fused") == (split[2] if split[0] == "fused" else None), key


@pytest.mark.parametrize("name", MPU[:1])
def test_fused_qkv_is_several_boxes_per_rank(name):
    """Megatron's fused QKV: each rank holds [q_r; k_r; v_r], so each rank gives 3 pieces."""
    from ckptkit.formats.registry import open_checkpoint

    index = open_checkpoint(str(DATA / name)).index
    entry = index.tensors["ds_module.layers.0.attention.query_key_value.weight"]
    assert entry.shape == (24, 8)
    starts = sorted(p.region.start for p in entry.pieces)
    assert starts == [r * 32 for r in range(6)]  # q0 q1 k0 k1 v0 v1 blocks of 4 rows x 8
    assert len({p.location.file for p in entry.pieces}) == 2


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    return dst


@pytest.mark.parametrize("name", MPU[:2])
def test_consolidate_and_convert_to_torch_are_exact(name, tmp_path):
    from safetensors.torch import load_file

    from ckptkit.ops.consolidate import consolidate
    from ckptkit.ops.convert import convert

    truth = _truth(name)
    consolidate(str(DATA / name), str(tmp_path / "st"))
    tensors = {}
    for f in sorted((tmp_path / "st").glob("*.safetensors")):
        tensors.update(load_file(f))
    params = [k[len("fp32.") :] for k in truth if k.startswith("fp32.")]
    assert sorted(tensors) == sorted(params)
    for p in params:
        assert tensors[p].dtype == torch.float32 and torch.equal(tensors[p], truth[f"fp32.{p}"]), p
    convert(str(DATA / name), str(tmp_path / "out.pt"), "torch")
    sd = torch.load(tmp_path / "out.pt", weights_only=True)
    for p in params:
        assert torch.equal(sd["model"][p], truth[f"fp32.{p}"]), p
    state = sd["optim"]["state"]
    names = [n for g in sd["optim"]["param_groups"] for n in g["params"]]
    for i, n in enumerate(names):
        slot = state[n] if n in state else state[i]
        assert torch.equal(slot["exp_avg"], truth[f"exp_avg.{n}"]), n


@pytest.mark.parametrize("name", MPU[:1])
def test_verify_diff_plan_and_inspect(name, tmp_path):
    from ckptkit.ops.diff import diff
    from ckptkit.ops.inspect import inspect, render, report_json
    from ckptkit.ops.verify import verify

    src = str(DATA / name)
    opened, problems = verify(src, deep=True)
    assert problems == []
    assert diff(src, str(_copy(name, tmp_path))).equal
    opened, report = inspect(src)
    lines = render(opened, report, max_rows=100)
    assert "parallel    tp 2 x dp 2" in lines
    qkv = next(line for line in lines if line.startswith("model.layers.0.attention.query_key_value.weight "))
    assert qkv.endswith("tp fused(3) dim 0/2")
    assert next(line for line in lines if line.startswith("model.final_layernorm.weight ")).endswith("tp replicated/2")
    doc = report_json(opened, report)
    assert doc["summary"]["parallel"] == {"tp": 2, "dp": 2}
    tensors = doc["tensors"]
    attrs = (
        tensors["model.layers.0.attention.dense.weight"]
        if isinstance(tensors, dict)
        else next(t for t in tensors if t["key"] == "model.layers.0.attention.dense.weight")
    )["attrs"]
    assert attrs["parallel"] == {"tp": {"dim": 1, "size": 2}}


def test_cli_reshard_and_convert_to_zero_refuse_and_plan_runs(tmp_path):
    from click.testing import CliRunner

    from ckptkit_cli.main import cli

    src = str(DATA / MPU[0])
    runner = CliRunner()
    res = runner.invoke(cli, ["reshard", src, str(tmp_path / "r"), "--world-size", "3"])  # tp 2 does not divide 3
    assert res.exit_code == 2 and "give the new sizes, e.g. --to tp=1,dp=3" in res.output, res.output
    assert not (tmp_path / "r" / "latest").exists()
    res = runner.invoke(cli, ["convert", src, str(tmp_path / "z"), "--to", "zero2", "--world-size", "2"])
    assert (
        res.exit_code != 0
        and "converting a tensor-parallel DeepSpeed checkpoint to ZeRO is not supported yet" in res.output
    )
    res = runner.invoke(cli, ["plan", "--json", src])
    assert res.exit_code == 0, res.output
    assert "query_key_value" in res.output


def test_no_rule_names_the_tensor_and_its_slices(tmp_path):
    from click.testing import CliRunner

    from ckptkit.convert.tp_rules import TpRules
    from ckptkit.errors import UnsupportedError
    from ckptkit.formats.deepspeed.read import read_index
    from ckptkit.storage.source import open_source

    src = DATA / MPU[0]
    with pytest.raises(
        UnsupportedError,
        match=r"no split rule decides 'word_embeddings.weight' \(its slices: "
        r"rank 0: \[8, 8\], rank 1: \[8, 8\]\).*--tp-rules FILE",
    ):
        read_index(open_source(str(src)), tp_rules=TpRules(()))
    from ckptkit_cli.main import cli

    bad = tmp_path / "rules.toml"
    bad.write_text('[[rules]]\npattern = "*"\nsplit = "sideways"\n')
    res = CliRunner().invoke(cli, ["inspect", "--tp-rules", str(bad), str(src)])
    assert res.exit_code == 2 and "split must be a dimension" in res.output and "Traceback" not in res.output


def test_a_rules_file_comes_before_the_builtin_rules(tmp_path):
    """A rule of the file wins over the built-in one (here: the fused QKV read as a plain dim-0
    split, which interleaves differently), and TOML and regex patterns work."""
    from ckptkit.convert.tp_rules import load_rules
    from ckptkit.formats.deepspeed.read import read_index
    from ckptkit.index.types import Box
    from ckptkit.runner.fetch import Fetcher
    from ckptkit.storage.source import open_source

    rules_file = tmp_path / "rules.toml"
    rules_file.write_text('[[rules]]\npattern = "re:.*query_key_value\\\\.(weight|bias)"\nsplit = 0\n')
    rules = load_rules(str(rules_file))
    assert rules.decide("layers.0.attention.query_key_value.weight", (24, 8)).kind == "split"
    assert rules.decide("x.q_proj.weight", None).dim == 0 and rules.decide("x.o_proj.weight", None).dim == 1
    source = open_source(str(DATA / MPU[0]))
    index = read_index(source, tp_rules=rules)
    entry = index.tensors["model.layers.0.attention.query_key_value.weight"]
    got = Fetcher(source, index=index).fetch(entry, Box.whole(entry.shape))
    truth = _truth(MPU[0])
    slices = [truth[f"slice.tp{r}.fp32.layers.0.attention.query_key_value.weight"] for r in range(2)]
    assert torch.equal(got, torch.cat(slices))  # rank by rank, as the rule says
    assert not torch.equal(got, truth["fp32.layers.0.attention.query_key_value.weight"])


def test_builtin_rules_cover_megatron_and_hf_names():
    from ckptkit.convert.tp_rules import load_rules

    rules = load_rules(None)
    want = {
        "language_model.embedding.word_embeddings.weight": ("split", 0),
        "layers.3.self_attention.query_key_value.bias": ("fused", 0),
        "layers.3.self_attention.dense.weight": ("split", 1),
        "layers.3.self_attention.dense.bias": ("replicated", None),
        "layers.3.mlp.dense_h_to_4h.bias": ("split", 0),
        "layers.3.mlp.dense_4h_to_h.bias": ("replicated", None),
        "model.layers.0.self_attn.k_proj.weight": ("split", 0),
        "model.layers.0.self_attn.o_proj.weight": ("split", 1),
        "model.layers.0.mlp.down_proj.bias": ("replicated", None),
        "model.layers.0.mlp.up_proj.bias": ("split", 0),
        "model.embed_tokens.weight": ("split", 0),
        "lm_head.weight": ("split", 0),
        "model.norm.weight": ("replicated", None),
        "model.layers.0.input_layernorm.weight": ("replicated", None),
    }
    for name, (kind, dim) in want.items():
        split = rules.decide(name, None)
        assert (split.kind, split.dim) == (kind, dim), name


@pytest.mark.skipif(not AUTOTP, reason="no AutoTP fixture (its generation failed: see VERSIONS.json 'failed')")
def test_autotp_splits_come_from_what_deepspeed_records():
    """AutoTP records universal_checkpoint_info: it keeps embed_tokens whole on every rank, where
    the built-in HF rule would split it; the recorded patterns win."""
    from ckptkit.convert.tp_rules import load_rules
    from ckptkit.formats.registry import open_checkpoint

    assert load_rules(None).decide("model.embed_tokens.weight", None).kind == "split"
    index = open_checkpoint(str(DATA / AUTOTP[0])).index
    splits = index.native.splits
    assert splits["model.embed_tokens.weight"].kind == "replicated"
    assert "universal_checkpoint_info" in splits["model.embed_tokens.weight"].rule
    assert (
        splits["model.layers.0.self_attn.o_proj.weight"].kind,
        splits["model.layers.0.self_attn.o_proj.weight"].dim,
    ) == ("split", 1)
    assert index.tensors["model.model.embed_tokens.weight"].attrs["parallel"]["tp"] == {"dim": None, "size": 2}


def test_verify_deep_finds_a_replicated_copy_that_differs(tmp_path):
    """Every tp rank saves the replicated tensors; the index reads rank 0's, verify --deep checks
    that rank 1's hold the same bytes (here one fp32 element of rank 1's layernorm master altered)."""
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.ops.verify import verify

    name = next(n for n in MPU if VERSIONS["fixtures"][n]["dtype"] == "fp32" and VERSIONS["fixtures"][n]["stage"] < 3)
    d = _copy(name, tmp_path)
    index = open_checkpoint(str(d)).index
    copies = index.native.replica_entries()["model.final_layernorm.weight"]
    assert [what for what, _ in copies] == ["model-parallel rank 1's copy"]
    piece = copies[0][1].pieces[0]
    path = d / piece.location.file
    data = bytearray(path.read_bytes())
    data[piece.location.offset] ^= 0x01  # the lowest mantissa bit of one element
    path.write_bytes(bytes(data))
    _, problems = verify(str(d), deep=True)
    assert any(
        "model.final_layernorm.weight: model-parallel rank 1's copy" in p and "differs" in p for p in problems
    ), problems


@pytest.mark.parametrize("name", AUTOTP[-1:] + MPU[:1])
def test_convert_to_fsdp2_loads_in_torch_dcp(name, tmp_path):
    """convert --to fsdp2 at 2 ranks (FSDP2's Shard(0) of the full tensors): torch's own DCP loader
    gives back DeepSpeed's full masters and moments."""
    import torch.distributed.checkpoint as dcp

    from ckptkit.ops.convert import convert

    out = tmp_path / "dcp"
    convert(str(DATA / name), str(out), "fsdp2", world_size=2)
    truth = _truth(name)
    params = [k[len("fp32.") :] for k in truth if k.startswith("fp32.")]
    model = {p: torch.empty_like(truth[f"fp32.{p}"]) for p in params}
    dcp.load({"model": model}, checkpoint_id=str(out), no_dist=True)
    for p in params:
        assert torch.equal(model[p], truth[f"fp32.{p}"]), p


def _fetch_with(rules_text: str, tmp_path: Path, key: str) -> torch.Tensor:
    from ckptkit.convert.tp_rules import load_rules
    from ckptkit.formats.deepspeed.read import read_index
    from ckptkit.index.types import Box
    from ckptkit.runner.fetch import Fetcher
    from ckptkit.storage.source import open_source

    rules_file = tmp_path / "rules.json"
    rules_file.write_text(rules_text)
    source = open_source(str(DATA / MPU[0]))
    index = read_index(source, tp_rules=load_rules(str(rules_file)))
    entry = index.tensors[key]
    return Fetcher(source, index=index).fetch(entry, Box.whole(entry.shape))


@pytest.mark.parametrize(
    "rule,key,dim,sizes",
    [
        # listed block sizes along dim 0 (grouped-query attention's Q/K/V of different widths)
        (
            '{"pattern": "*.dense_h_to_4h.weight", "fused": [8, 24], "dim": 0}',
            "model.layers.0.mlp.dense_h_to_4h.weight",
            0,
            [4, 12],
        ),
        # equal blocks along dim 1: each rank's blocks are strided boxes of its slice
        (
            '{"pattern": "*.dense_4h_to_h.weight", "fused": 2, "dim": 1}',
            "optim.state.layers.0.mlp.dense_4h_to_h.weight.exp_avg",
            1,
            [8, 8],
        ),
    ],
)
def test_fused_rules_place_each_block_of_each_rank(rule, key, dim, sizes, tmp_path):
    """Real slices read under a fused rule land where the rule says: block b of the full tensor is
    [rank 0's part of b; rank 1's part of b] along `dim` (checked against DeepSpeed's slices)."""
    got = _fetch_with('{"rules": [%s]}' % rule, tmp_path, key)
    truth = _truth(MPU[0])
    kind = "exp_avg" if key.endswith(".exp_avg") else "fp32"
    param = key[len("model.") :] if kind == "fp32" else key[len("optim.state.") : -len(".exp_avg")]
    slices = [truth[f"slice.tp{r}.{kind}.{param}"] for r in range(2)]
    parts = [s.split(sizes, dim=dim) for s in slices]
    want = torch.cat([torch.cat([p[b] for p in parts], dim=dim) for b in range(len(sizes))], dim=dim)
    assert torch.equal(got, want)
    assert not torch.equal(got, torch.cat(slices, dim=dim))


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"rules": [{"pattern": "re:(", "split": 0}]}', "is not a regular expression"),
        ('{"rules": [{"pattern": "x", "split": 0, "fused": 2}]}', "give exactly one of"),
        ('{"rules": [{"pattern": "x", "dims": 0}]}', r"unknown field\(s\) \['dims'\]"),
        ('{"rules": [{"pattern": "x", "fused": [4, 0]}]}', "fused must be a count"),
        ('{"rules": [{"split": 0}]}', 'with a "pattern" string'),
        ('{"builtin": "no", "rules": []}', '"builtin" must be true or false'),
        ('{"rules": [', "is not valid JSON"),
    ],
)
def test_bad_rules_files_are_named(text, message, tmp_path):
    from ckptkit.convert.tp_rules import load_rules
    from ckptkit.errors import FormatError

    f = tmp_path / "rules.json"
    f.write_text(text)
    with pytest.raises(FormatError, match=message):
        load_rules(str(f))


def test_a_rule_splitting_a_missing_dimension_is_refused(tmp_path):
    from ckptkit.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=r"splits dimension 2 of 'layers.0.mlp.dense_h_to_4h.weight'"):
        _fetch_with(
            '{"rules": [{"pattern": "*.dense_h_to_4h.weight", "split": 2}]}',
            tmp_path,
            "model.layers.0.mlp.dense_h_to_4h.weight",
        )


def test_recorded_universal_checkpoint_info_is_read_in_ds_to_universal_order():
    """The keys Megatron-DeepSpeed and AutoTP write (deepspeed/checkpoint/constants.py), read as
    ds_to_universal's merge_tp_slices does: re.match patterns, replicated before the others, any
    other parameter along dim 0; AutoTP's unsupported patterns refuse by name."""
    from ckptkit.convert.tp_rules import recorded_rules
    from ckptkit.errors import UnsupportedError

    info = {
        "tp_replicated_parameter_patterns": [r"\w+\.\d+\.input_layernorm\.weight"],
        "parameter_to_average_patterns": [r"tied_modules\.embed\.word_embeddings\.norm\.weight"],
        "parameter_with_row_parallelism_patterns": [
            r"\w+\.\d+\.mlp\.dense_4h_to_h\.weight",
            r"\w+\.\d+\.input_layernorm\.weight",
        ],
        "parameter_with_2_sub_params_cat_dim_0": [r"\w+\.\d+\.mlp\.dense_h_to_4h\.weight"],
        "parameter_with_sub_params": [{"patterns": [r".*qkv\.weight$"], "shape": [[16, 8, 8], -1], "partition_dim": 0}],
        "vocabulary_parameter_patterns": [r"tied_modules\.embed\.word_embeddings\.weight"],
        "autotp_unsupported_parameter_patterns": {r"^odd\.weight$": "uneven head split"},
    }
    rules = recorded_rules(info, "ckpt")
    got = {
        n: (
            rules.decide(n, None).kind,
            rules.decide(n, None).dim,
            rules.decide(n, None).parts,
            rules.decide(n, None).count,
        )
        for n in [
            "layers.3.input_layernorm.weight",
            "tied_modules.embed.word_embeddings.norm.weight",
            "layers.3.mlp.dense_4h_to_h.weight",
            "layers.3.mlp.dense_h_to_4h.weight",
            "attn.qkv.weight",
            "tied_modules.embed.word_embeddings.weight",
            "layers.3.attention.dense.weight",
        ]
    }
    assert got == {
        "layers.3.input_layernorm.weight": ("replicated", None, None, None),
        "tied_modules.embed.word_embeddings.norm.weight": ("replicated", None, None, None),
        "layers.3.mlp.dense_4h_to_h.weight": ("split", 1, None, None),
        "layers.3.mlp.dense_h_to_4h.weight": ("fused", 0, None, 2),
        "attn.qkv.weight": ("fused", 0, (16, 8, 8), None),
        "tied_modules.embed.word_embeddings.weight": ("split", 0, None, None),
        "layers.3.attention.dense.weight": ("split", 0, None, None),
    }
    with pytest.raises(UnsupportedError, match="records 'odd.weight' as not convertible"):
        rules.decide("odd.weight", None)
    assert recorded_rules({"universal_checkpoint_version": 0.4}, "ckpt") is None


@pytest.mark.skipif(not AUTOTP, reason="no AutoTP fixture (its generation failed: see VERSIONS.json 'failed')")
def test_autotp_consolidated_loads_into_the_full_hf_model(tmp_path):
    """The consolidated safetensors of an AutoTP checkpoint carry HF's names and the full shapes:
    the un-sharded LlamaForCausalLM the fixture was built from loads it strictly."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from ckptkit.ops.consolidate import consolidate

    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_ds_tp", DATA.parent.parent / "generate_ds_tp.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)  # its LLAMA: the LlamaConfig the fixtures were built from
    name = AUTOTP[0]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**generator.LLAMA))
    consolidate(str(DATA / name), str(tmp_path / "st"))
    state = load_file(tmp_path / "st" / "model.safetensors")
    model.load_state_dict(state, strict=True)
    truth = _truth(name)
    for p, t in model.state_dict().items():
        assert torch.equal(t, truth[f"fp32.{p}"]), p
