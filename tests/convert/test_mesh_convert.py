"""`ckptkit convert SRC OUT --to fsdp2 --world-size mesh=...`: a DeepSpeed tensor-parallel or pipeline
checkpoint as DCP on a device mesh (FSDP2 + TP), each tensor's tp split from what the source records.

Fixtures: fixtures/data/ds_tp (DeepSpeed AutoTP Llama and a Megatron-style mpu model with fused QKV,
tp=2 x dp=2, written by fixtures/generate_ds_tp.py) and fixtures/data/ds_pp (PipelineModule,
fixtures/generate_ds_pp.py); their truth files hold DeepSpeed's own full fp32 masters and moments.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from click.testing import CliRunner

from ckptkit.errors import UnsupportedError
from ckptkit.index import mesh as meshes
from ckptkit.index.parallel_spec import parse_parallel
from ckptkit.ops.convert import convert
from conftest import DATA, ROOT, assert_tensor_equal, subprocess_env, torchrun_cmd
from helpers.dcp_items import dcp_items

TP = DATA / "ds_tp"
PP = DATA / "ds_pp"
MESH = "mesh=dp_shard:2,tp:2"


def _full_tensors(path) -> tuple[dict, dict, dict]:
    """(each tensor assembled whole from its chunks as torch reads them, the values, the chunk lists)."""
    _, chunks, values = dcp_items(path)
    full, objects = {}, {}
    for key, listed in chunks.items():
        if listed[0][0] is None:
            objects[key] = values[(key, None)]
            continue
        parts = [(offsets, sizes, values[(key, offsets)]) for offsets, sizes, _ in listed]
        shape = tuple(max(o[d] + s[d] for o, s, _ in parts) for d in range(len(parts[0][0])))
        out = torch.empty(shape, dtype=parts[0][2].dtype)
        for offsets, sizes, value in parts:
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = value
        full[key] = out
    return full, objects, chunks


def _truth(path) -> dict:
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("name", ["autotp_z2_fp32", "autotp_z1_bf16", "autotp_z3_bf16", "mpu_z2_fp32", "mpu_z1_bf16"])
def test_tp_checkpoint_on_a_mesh_holds_deepspeeds_truth_split_as_recorded(tmp_path, name):
    """Every fp32 master and Adam moment, read back by torch's own loader from the chunks, equals
    DeepSpeed's (safe_get_full_*) bit for bit, every step is DeepSpeed's global step; and each
    parameter's chunks are DTensor's for the split DeepSpeed recorded (fixture.json), e.g. row-parallel
    o_proj on dim 1, AutoTP's replicated embedding, Megatron's fused QKV as Shard(0) of [Q; K; V]."""
    res = convert(str(TP / name), str(tmp_path / "o"), "fsdp2", world_size=MESH)
    assert res.world_size == 4 and res.notes[0] == f"laid out on {MESH}"
    truth = _truth(TP / f"{name}.truth.pt")
    full, _, chunks = _full_tensors(tmp_path / "o")
    splits = json.loads((TP / name / "fixture.json").read_text())["splits"]
    names = [k[len("fp32.") :] for k in truth if k.startswith("fp32.")]
    assert names and set(splits) == set(names)
    mesh = parse_parallel(MESH)
    fused = 0
    for p in names:
        assert_tensor_equal(full[f"model.{p}"], truth[f"fp32.{p}"], p)
        for moment in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(full[f"optim.state.{p}.{moment}"], truth[f"{moment}.{p}"], f"{p} {moment}")
        assert full[f"optim.state.{p}.step"].item() == truth["global_steps"]
        kind, *rest = splits[p]
        fused += kind == "fused"
        placement = meshes.Placement(True, None if kind == "replicated" else rest[0])
        want = {
            (b.offsets, b.sizes) for b in meshes.rank_boxes(tuple(truth[f"fp32.{p}"].shape), mesh, placement) if b.numel
        }
        for key in (f"model.{p}", f"optim.state.{p}.exp_avg"):
            assert {(o, s) for o, s, _ in chunks[key] if o is not None and all(s)} == want, key
    assert fused == (2 if name.startswith("mpu") else 0)
    assert any("fused tensors" in n for n in res.notes) == bool(fused)


def test_pipeline_onto_a_tp_mesh_needs_split_rules_then_follows_them(tmp_path):
    """A source that records no tp split (a DeepSpeed pipeline) onto a mesh with tp: the built-in
    rules decide none of PipelineModule's names, so the tensor is named; given rules, the chunks
    follow them and the values are DeepSpeed's."""
    src = str(PP / "pp2_dp2_z1_fp32")
    with pytest.raises(UnsupportedError, match=r"tied_modules\.embed\.weight"):
        convert(src, str(tmp_path / "no"), "fsdp2", world_size=MESH)
    assert not (tmp_path / "no").exists()
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps(
            {
                "rules": [
                    {"pattern": "*.fc_in.*", "split": 0},
                    {"pattern": "*.fc_out.weight", "split": 1},
                    {"pattern": "*", "split": "replicated"},
                ]
            }
        )
    )
    from ckptkit.convert.tp_rules import use_rules_file

    use_rules_file(str(rules))
    try:
        res = convert(src, str(tmp_path / "o"), "fsdp2", world_size=MESH)
    finally:
        use_rules_file(None)
    assert "tp splits of 14 parameters: 14 from the split rules" in res.notes
    full, _, chunks = _full_tensors(tmp_path / "o")
    truth = _truth(PP / "pp2_dp2_z1_fp32.truth.pt")
    for key, value in truth.items():
        kind, _, p = key.partition(".")
        if kind in ("fp32", "frozen", "buffer"):
            assert_tensor_equal(full[f"model.{p}"], value, key)
        elif kind in ("exp_avg", "exp_avg_sq"):
            assert_tensor_equal(full[f"optim.state.{p}.{kind}"], value, key)
    # fc_out (8, 6) split on dim 1 by tp 2: column offsets 0 and 3; fc_in (6, 8) on dim 0
    assert {o[1] for o, _, _ in chunks["model.1.fc_out.weight"]} == {0, 3}
    assert {o[1] for o, _, _ in chunks["model.1.fc_in.weight"]} == {0}


def test_dcp_saved_with_tp_converts_onto_a_mesh_as_torch_saves_it(tmp_path):
    """A DCP source saved by FSDP2 + TP (its tp splits inferred from the chunks and recorded by the
    reader) converted to (dp_shard 4, tp 2) is item by item torch's own dcp.save at that mesh
    (fixtures/data/mesh/ref_fsdp_tp_d4t2): key order, chunks, rank files (param-group values
    included: their order is taken from the source's save) and bits."""
    mesh_data = DATA / "mesh"
    convert(str(mesh_data / "fsdp_tp_d2t2"), str(tmp_path / "o"), "fsdp2", world_size="mesh=dp_shard:4,tp:2")
    got_order, got_chunks, got_values = dcp_items(tmp_path / "o")
    ref_order, ref_chunks, ref_values = dcp_items(mesh_data / "ref_fsdp_tp_d4t2")
    assert got_order == ref_order and got_chunks == ref_chunks
    assert sum(cs[0][0] is not None for cs in ref_chunks.values()) >= 50
    for item, expected in ref_values.items():
        if isinstance(expected, torch.Tensor):
            assert_tensor_equal(got_values[item], expected, str(item))
        else:
            assert got_values[item] == expected, item


@pytest.mark.parametrize(
    "args,message",
    [
        (["--world-size", "tp=2,dp=2"], "reshard --to"),
        (["--world-size", "abc"], "expected a number of ranks"),
        (["--world-size", "mesh=dp_shard:2,xx:2"], "not one of"),
        (["--world-size", "mesh=tp:2"], "needs dp_shard"),
        (["--world-size", "mesh=tp:2,dp_shard:2"], "in the order"),
        (["--world-size", "0"], "at least 1"),
    ],
)
def test_bad_world_size_is_one_sentence_exit_2(tmp_path, args, message):
    from cli.main import cli

    out = tmp_path / "bad"
    res = CliRunner().invoke(cli, ["convert", str(TP / "autotp_z2_fp32"), str(out), "--to", "fsdp2", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output and not out.exists()


def test_mesh_applies_to_dcp_targets_only(tmp_path):
    from cli.main import cli

    res = CliRunner().invoke(
        cli, ["convert", str(TP / "autotp_z2_fp32"), str(tmp_path / "z"), "--to", "zero2", "--world-size", MESH]
    )
    assert res.exit_code == 2 and "applies only to --to dcp, fsdp or fsdp2" in res.output
    ok = CliRunner().invoke(
        cli, ["convert", str(TP / "autotp_z2_fp32"), str(tmp_path / "d"), "--to", "dcp", "--world-size", MESH]
    )
    assert ok.exit_code == 0 and "for 4 rank(s)" in ok.output and f"laid out on {MESH}" in ok.output


@pytest.mark.slow
def test_torch_jobs_load_the_converted_checkpoints_and_save_the_same_layout(tmp_path):
    """One torchrun job (4 processes, gloo): LlamaForCausalLM parallelized as torchtitan does on
    (dp_shard 2, tp 2) loads the AutoTP convert, and a plain module with PipelineModule's names under
    1-D FSDP2 loads the pipeline's `--world-size 4` convert; every master, moment, frozen weight,
    buffer and step equals DeepSpeed's truth bit for bit, and each trains a step. The job's own
    dcp.save of what it loaded equals ckptkit's mesh output item by item: the same chunk list per
    tensor, each chunk in the same rank's file, the same bits (for the pipeline, the
    `--world-size mesh=dp_shard:4` output; `--world-size 4` keeps ckptkit's older 1-D layout)."""
    tp_src, pp_src = TP / "autotp_z1_bf16", PP / "pp2_dp2_z1_fp32"
    convert(str(tp_src), str(tmp_path / "tp"), "fsdp2", world_size=MESH)
    convert(str(pp_src), str(tmp_path / "pp"), "fsdp2", world_size=4)
    convert(str(pp_src), str(tmp_path / "pp_mesh"), "fsdp2", world_size="mesh=dp_shard:4")
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(4) + [
        str(ROOT / "tests" / "dist" / "mesh_convert_check.py"),
        "--tp-ckpt",
        str(tmp_path / "tp"),
        "--tp-truth",
        str(TP / "autotp_z1_bf16.truth.pt"),
        "--pp-ckpt",
        str(tmp_path / "pp"),
        "--pp-truth",
        str(PP / "pp2_dp2_z1_fp32.truth.pt"),
        "--resave",
        str(tmp_path / "resaved"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result.read_text())
    assert doc["ok"] and doc["world_size"] == 4, doc
    assert (
        doc["tp"]["compared"] == 48 and doc["pp"]["compared"] == 55
    )  # 12 params x (w, 2 moments, step); 13 x 4 + frozen + 2 buffers
    for ours, theirs in (("tp", "tp"), ("pp_mesh", "pp")):
        got_order, got_chunks, got_values = dcp_items(tmp_path / ours)
        ref_order, ref_chunks, ref_values = dcp_items(tmp_path / "resaved" / theirs)
        # ckptkit also keeps DeepSpeed's own values (ds.*) and client state, which the job has no place for
        extra = set(got_chunks) - set(ref_chunks)
        assert extra and not any(k.startswith(("model.", "optim.")) for k in extra), extra
        assert set(ref_chunks) <= set(got_chunks)
        assert [k for k in got_order if k in ref_chunks] == ref_order
        assert {k: got_chunks[k] for k in ref_chunks} == ref_chunks, ours
        for item, expected in ref_values.items():
            if isinstance(expected, torch.Tensor):
                assert_tensor_equal(got_values[item], expected, str(item))
            else:
                assert type(got_values[item]) is type(expected) and got_values[item] == expected, item
        assert len({f for cs in ref_chunks.values() for _, _, f in cs}) == 4
