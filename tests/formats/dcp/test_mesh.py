"""DCP on 2-D meshes: reading FSDP2+TP and HSDP checkpoints, and `reshard --to mesh=...` writing
exactly what torch's own dcp.save writes for that mesh.

Fixtures (fixtures/generate_mesh.py, real torch runs under torchrun): `fsdp_tp_d2t2` (FSDP2 + TP
on ("dp_shard", "tp") = (2, 2)) and `hsdp_r2s2` (HSDP on ("dp_replicate", "dp_shard") = (2, 2)),
and REFERENCES `ref_*`: the same state loaded by torch at a target mesh and saved by dcp.save.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ckptkit.errors import UnsupportedError, UsageError
from ckptkit.index import mesh as meshes
from ckptkit.index.parallel_spec import MeshSpec, ParallelSizes, parse_parallel
from ckptkit.ops.consolidate import consolidate
from ckptkit.ops.reshard import reshard
from conftest import DATA, ROOT, assert_tensor_equal, subprocess_env, torchrun_cmd
from helpers.dcp_items import dcp_items

MESH = DATA / "mesh"
SOURCES = {"fsdp_tp_d2t2": "mesh=dp_shard:2,tp:2", "hsdp_r2s2": "mesh=dp_replicate:2,dp_shard:2"}
REFERENCES = json.loads((MESH / "VERSIONS.json").read_text())["references"]


def _truth(name: str) -> dict:
    return torch.load(MESH / f"{name}.truth.pt", weights_only=True)


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    out = {}
    for name, ref in REFERENCES.items():
        path = tmp_path_factory.mktemp("mesh") / name
        reshard(str(MESH / ref["source"]), str(path), "mesh=" + ref["mesh"])
        out[name] = path
    return out


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_reshard_to_mesh_is_what_torch_writes(resharded, name):
    """Item by item against torch's own dcp.save at that mesh: the same keys in the same order,
    the same chunk list per tensor (offsets, sizes), each chunk in the same rank's file, and the
    same value in it (dtype, shape, bits; values with ==)."""
    got_order, got_chunks, got_values = dcp_items(resharded[name])
    ref_order, ref_chunks, ref_values = dcp_items(MESH / name)
    assert got_order == ref_order
    assert got_chunks == ref_chunks
    assert set(got_values) == set(ref_values)
    for item, expected in ref_values.items():
        if isinstance(expected, torch.Tensor):
            assert_tensor_equal(got_values[item], expected, str(item))
        else:
            assert type(got_values[item]) is type(expected) and got_values[item] == expected, item
    # the fixtures exercise what this must get right: several ranks, replicated items placed by
    # torch's dedup on ranks other than 0, split chunks on a dim other than 0 where tp is there
    files = {f for cs in ref_chunks.values() for _, _, f in cs}
    assert (
        len(files)
        == MeshSpec(
            tuple((d, int(s)) for d, s in (p.split(":") for p in REFERENCES[name]["mesh"].split(",")))
        ).world_size
    )
    assert len(ref_values) >= 68


def test_reshard_of_a_mesh_reshard_is_still_torchs_layout(resharded, tmp_path):
    """ckptkit's own output is a source like torch's: its mesh is inferred again and the state
    dict's order is kept (planner_data), so a second reshard matches torch's save at that mesh."""
    reshard(str(resharded["ref_fsdp_tp_d4t2"]), str(tmp_path / "again"), "mesh=dp_shard:1,tp:4")
    got, want = dcp_items(tmp_path / "again"), dcp_items(MESH / "ref_fsdp_tp_d1t4")
    assert got[0] == want[0] and got[1] == want[1]
    for item, expected in want[2].items():
        if isinstance(expected, torch.Tensor):
            assert_tensor_equal(got[2][item], expected, str(item))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_source_mesh_is_inferred_from_the_chunks(name):
    from ckptkit.formats.registry import open_checkpoint

    found, placements = meshes.infer_source_mesh(open_checkpoint(str(MESH / name)).index)
    assert str(found) == SOURCES[name]
    if "tp" in name:  # torchtitan's plan: colwise q/k/v/up/lm_head/embedding rows, rowwise o/down
        assert placements["model.layers.0.attn.wq.weight"] == meshes.Placement(True, 0)
        assert placements["optim.state.layers.0.attn.wo.weight.exp_avg"] == meshes.Placement(True, 1)
        assert placements["model.norm.weight"] == meshes.Placement(True, None)
    assert placements["optim.state.norm.weight.step"] == meshes.PLAIN


def test_reshard_with_the_source_mesh_given_is_the_same(resharded, tmp_path):
    reshard(str(MESH / "fsdp_tp_d2t2"), str(tmp_path / "o"), "mesh=dp_shard:4,tp:2", expect_from="mesh=dp_shard:2,tp:2")
    assert dcp_items(tmp_path / "o")[1] == dcp_items(resharded["ref_fsdp_tp_d4t2"])[1]
    with pytest.raises(UnsupportedError, match="not what FSDP2/HSDP/TP on mesh=dp_shard:4 writes"):
        reshard(str(MESH / "fsdp_tp_d2t2"), str(tmp_path / "o2"), "mesh=dp_shard:2,tp:2", expect_from="mesh=dp_shard:4")


def test_local_box_is_dtensors_own(tmp_path):
    """The port of compute_local_shape_and_global_offset gives torch's chunk for FSDP2 (+TP, with
    _StridedShard) placements, on uneven and empty shards too."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    meshes_ = [
        MeshSpec((("dp_shard", 4), ("tp", 2))),
        MeshSpec((("dp_replicate", 2), ("dp_shard", 3), ("tp", 2))),
        MeshSpec((("dp_shard", 3), ("tp", 4))),
        MeshSpec((("dp_replicate", 2), ("dp_shard", 5))),
    ]
    checked = 0
    for mesh in meshes_:
        for shape in [(30, 16), (7, 5), (3,), (1, 6), (24,), (13, 2)]:
            for tp_dim in [None] + list(range(len(shape))):
                p = meshes.Placement(True, tp_dim)
                torch_p = []
                for kind, dim, split in meshes.mesh_placements(mesh, p):
                    torch_p.append(
                        Replicate()
                        if kind == "R"
                        else Shard(dim)
                        if kind == "S"
                        else _StridedShard(dim, split_factor=split)
                    )
                sizes = [s for _, s in mesh.dims]
                for rank in range(mesh.world_size):
                    coord = [mesh.coordinates(rank)[n] for n in mesh.names]
                    local, offset = _compute_local_shape_and_global_offset(shape, sizes, coord, torch_p)
                    try:
                        box = meshes.local_box(shape, mesh, rank, p)
                    except UnsupportedError:  # torch's chunk would not be contiguous: refused, never wrong
                        continue
                    assert (box.offsets, box.sizes) == (tuple(offset), tuple(local)), (mesh, shape, tp_dim, rank)
                    checked += 1
    assert checked > 500


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_consolidate_2d_mesh_checkpoint_equals_truth(tmp_path, name):
    """Reading: model and optimizer of an FSDP2+TP / HSDP checkpoint, bit for bit."""
    truth = _truth(name)
    consolidate(str(MESH / name), str(tmp_path / "out"), include_optimizer=True)
    model = load_file(str(tmp_path / "out" / "model.safetensors"))
    optim = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    expected_model = {k[len("model.") :]: v for k, v in truth.items() if k.startswith("model.")}
    expected_optim = {
        k[len("optim.") :]: v for k, v in truth.items() if k.startswith("optim.") and isinstance(v, torch.Tensor)
    }
    assert set(model) == set(expected_model) and set(optim) == set(expected_optim)
    for key, value in expected_model.items():
        assert_tensor_equal(model[key], value, key)
    for key, value in expected_optim.items():
        assert_tensor_equal(optim[key], value, key)
    assert len(expected_model) + len(expected_optim) == 56


def test_to_world_size_stays_fsdp2_dp_only(tmp_path):
    """A plain integer is today's DP-only reshard (the same call as before): a 2-D source goes to
    FSDP2 Shard(0) at 3 ranks, still the full state bit for bit."""
    assert parse_parallel("16") == 16 and parse_parallel(3) == 3
    res = reshard(str(MESH / "fsdp_tp_d2t2"), str(tmp_path / "o"), "3")
    assert res.to_world_size == 3 and sorted(res.files)[-1] == "__2_0.distcp"
    chunks = dcp_items(tmp_path / "o")[1]["model.layers.0.attn.wo.weight"]
    assert [c[:2] for c in chunks] == [((0, 0), (6, 16)), ((6, 0), (6, 16)), ((12, 0), (4, 16))]
    consolidate(str(tmp_path / "o"), str(tmp_path / "full"), include_optimizer=True)
    full = {
        **load_file(str(tmp_path / "full" / "model.safetensors")),
        **{"optim." + k: v for k, v in load_file(str(tmp_path / "full" / "optimizer.safetensors")).items()},
    }
    for key, value in _truth("fsdp_tp_d2t2").items():
        if isinstance(value, torch.Tensor):
            assert_tensor_equal(full[key[len("model.") :] if key.startswith("model.") else key], value, key)


def test_parallel_spec_parses_meshes_and_deepspeed_sizes():
    spec = parse_parallel("mesh=dp_replicate:2,dp_shard:2,tp:2")
    assert spec == MeshSpec((("dp_replicate", 2), ("dp_shard", 2), ("tp", 2))) and spec.world_size == 8
    assert spec.coordinates(5) == {"dp_replicate": 1, "dp_shard": 0, "tp": 1}
    assert parse_parallel("tp=2,pp=2,dp=4") == ParallelSizes(tp=2, pp=2, dp=4)
    assert parse_parallel("ep=4,dp=8") == ParallelSizes(ep=4, dp=8)
    for bad, why in [
        ("0", "at least 1"),
        ("mesh=dp_shard:4,xx:2", "not one of"),
        ("mesh=tp:2", "needs dp_shard"),
        ("mesh=dp_shard:2,dp_shard:2", "given twice"),
        ("tp=2,qq=3", "not one of"),
        ("mesh=dp_shard:x", "is not name:size"),
        ("mesh=dp_shard:0", "at least 1"),
    ]:
        with pytest.raises(UsageError, match=why):
            parse_parallel(bad)


@pytest.mark.parametrize(
    "to,message",
    [
        ("tp=2,pp=2,dp=4", "not supported yet for dcp"),
        ("ep=4,dp=8", "not supported yet for dcp"),
        ("mesh=tp:2,dp_shard:2", "in the order dp_replicate, dp_shard, tp"),
        ("mesh=dp_shard:2,pp:2", "not one of"),
        ("four", "is not name=size"),
    ],
)
def test_bad_or_unsupported_to_is_one_sentence_exit_2(tmp_path, to, message):
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "reshard", str(MESH / "fsdp_tp_d2t2"), str(tmp_path / "o"), "--to", to],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "o").exists()


def test_mesh_with_tp_over_a_source_without_tp_needs_a_rule(tmp_path):
    with pytest.raises(UnsupportedError, match="no tensor-parallel split rule matches"):
        reshard(str(MESH / "hsdp_r2s2"), str(tmp_path / "o"), "mesh=dp_shard:2,tp:2")
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps(
            {
                "rules": [
                    {"pattern": "re:.*(wq|wk|wv|up|lm_head|embed)\\.(weight|bias)$", "split": 0},
                    {"pattern": "re:.*(wo|down)\\.weight$", "split": 1},
                    {"pattern": "re:.*(norm.*|down\\.bias)$", "split": "replicated"},
                ]
            }
        )
    )
    reshard(str(MESH / "hsdp_r2s2"), str(tmp_path / "o2"), "mesh=dp_shard:2,tp:2", tp_rules=str(rules))
    # the layout is torch's FSDP2+TP layout at (2, 2): the same chunks as the fsdp_tp_d2t2 fixture
    got = dcp_items(tmp_path / "o2")[1]
    want = dcp_items(MESH / "fsdp_tp_d2t2")[1]
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize(
    "source,target", [("fsdp_tp_d2t2", "dp_shard:1,tp:4"), ("hsdp_r2s2", "dp_replicate:1,dp_shard:4")]
)
def test_torch_job_loads_mesh_reshard_and_trains(tmp_path, source, target):
    """torch itself, at the new mesh, loads the resharded folder (dcp.load + set_state_dict), finds
    every weight and optimizer moment equal to the truth bit for bit, and trains one step."""
    out = tmp_path / "out"
    reshard(str(MESH / source), str(out), "mesh=" + target)
    result = tmp_path / "result.json"
    cmd = torchrun_cmd(4) + [
        str(ROOT / "tests" / "dist" / "mesh_load_check.py"),
        "--ckpt",
        str(out),
        "--mesh",
        target,
        "--truth",
        str(MESH / f"{source}.truth.pt"),
        "--result",
        str(result),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result.read_text())
    assert doc["ok"], doc
    assert doc["world_size"] == 4 and doc["compared"] == 68 and not doc["mismatches"] and doc["trained_step"]


def test_inspect_shows_the_mesh_and_each_tensors_tp_split():
    from ckptkit.formats.registry import open_checkpoint

    tp = open_checkpoint(str(MESH / "fsdp_tp_d2t2")).index
    assert tp.metadata["mesh"] == "dp_shard:2,tp:2" and tp.metadata["parallel"] == {"tp": 2, "dp": 2}
    assert tp.tensors["model.layers.0.mlp.down.weight"].attrs["parallel"] == {"tp": {"dim": 1, "size": 2}}
    assert tp.tensors["optim.state.embed.weight.exp_avg"].attrs["parallel"] == {"tp": {"dim": 0, "size": 2}}
    assert tp.tensors["model.norm.weight"].attrs["parallel"] == {"tp": {"dim": None, "size": 2}}
    assert "parallel" not in tp.tensors["optim.state.norm.weight.step"].attrs
    hsdp = open_checkpoint(str(MESH / "hsdp_r2s2")).index
    assert hsdp.metadata["mesh"] == "dp_replicate:2,dp_shard:2" and "parallel" not in hsdp.metadata
    plain = open_checkpoint(str(DATA / "fsdp2_w3")).index
    assert "mesh" not in plain.metadata and not any("parallel" in e.attrs for e in plain.tensors.values())
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "inspect", str(MESH / "fsdp_tp_d2t2")],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "parallel    tp 2 x dp 2" in proc.stdout and "tp dim 1/2" in proc.stdout and "tp replicated/2" in proc.stdout


def test_source_whose_chunks_fit_no_mesh_is_laid_out_by_role(tmp_path):
    """A DCP folder cut in a way no mesh cuts (here: uneven rows, written by ckptkit's writer) still
    reshards to a mesh without tp: parameters are those with optimizer state, the rest plain."""
    from ckptkit.context import RunContext
    from ckptkit.formats.dcp.writer import write_dcp
    from ckptkit.formats.registry import open_checkpoint
    from ckptkit.index.layouts import Assignment, Layout
    from ckptkit.index.types import Box
    from ckptkit.runner.fetch import Fetcher
    from ckptkit.storage.output import open_output

    opened = open_checkpoint(str(MESH / "hsdp_r2s2"))
    index = opened.index
    layout = Layout(2)
    for key, entry in index.tensors.items():
        if len(entry.shape) and entry.shape[0] > 3:  # rows [0, 3) on rank 0, the rest on rank 1
            rest = (entry.shape[0] - 3,) + tuple(entry.shape[1:])
            layout.tensors[key] = [
                Assignment(0, Box((0,) * len(entry.shape), (3,) + tuple(entry.shape[1:]))),
                Assignment(1, Box((3,) + (0,) * (len(entry.shape) - 1), rest)),
            ]
        else:
            layout.tensors[key] = [Assignment(0, Box.whole(entry.shape))]
    with open_output(str(tmp_path / "odd"), overwrite=False) as out:
        write_dcp(out, index, Fetcher(opened.source, index=index), layout, ctx=RunContext(), source=opened.source)
    with pytest.raises(UnsupportedError):
        meshes.infer_source_mesh(open_checkpoint(str(tmp_path / "odd")).index)
    res = reshard(str(tmp_path / "odd"), str(tmp_path / "r1s4"), "mesh=dp_replicate:1,dp_shard:4")
    assert "fit no mesh" in res.notes[0]
    got, want = dcp_items(tmp_path / "r1s4"), dcp_items(MESH / "ref_hsdp_r1s4")
    # every chunk torch's; each sharded chunk in torch's rank file. The file of an item every rank
    # holds (steps, values) follows the state-dict order in planner_data, which ckptkit's writer of
    # this odd source recorded in its own order, so those may sit in other (valid) files
    assert {k: [c[:2] for c in cs] for k, cs in got[1].items()} == {k: [c[:2] for c in cs] for k, cs in want[1].items()}
    assert {k: cs for k, cs in got[1].items() if len(cs) > 1} == {k: cs for k, cs in want[1].items() if len(cs) > 1}
    for item, expected in want[2].items():
        if isinstance(expected, torch.Tensor):
            assert_tensor_equal(got[2][item], expected, str(item))


def test_mesh_reshard_needs_no_torch(tmp_path):
    """Reading a 2-D folder and writing a mesh (TP's Shard(1) chunks included, streamed as runs
    of rows) import no torch, as the other light commands."""
    from helpers.torch_import_probe import torch_imported

    assert not torch_imported(
        ["reshard", str(MESH / "fsdp_tp_d2t2"), str(tmp_path / "o"), "--to", "mesh=dp_replicate:2,dp_shard:2,tp:2"]
    )
    assert (tmp_path / "o" / ".metadata").exists()
