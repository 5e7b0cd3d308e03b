"""consolidate without --include-optimizer opens a ZeRO checkpoint with `optimizer=False`: the
reader reads and checks the optimizer state as always but only counts its per-parameter entries
(formats/protocols.UNINDEXED_OPTIMIZER) instead of indexing them (40k entries of a 20k
parameter ZeRO-3 checkpoint that consolidate never writes).

Checked on the real fixtures: such an index is the full index less exactly the optimizer's
per-parameter entries, which it counts; consolidate says the same "not written" counts as from the
full index; tensor-parallel, expert and pipeline checkpoints are indexed whole regardless; and
damage in the optimizer state is still refused in the same one sentence.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ckptkit.convert.keys import split_roles
from ckptkit.formats.protocols import UNINDEXED_OPTIMIZER
from ckptkit.formats.registry import open_checkpoint
from ckptkit.ops.consolidate import consolidate
from conftest import DATA

PLAIN = [
    p
    for base in ("deepspeed", "deepspeed_optimizers")
    if (DATA / base).exists()
    for p in sorted((DATA / base).iterdir())
    if p.is_dir()
]
OTHER = [
    p
    for base in ("ds_tp", "ds_moe", "ds_pp", "ds_pp_moe")
    if (DATA / base).exists()
    for p in sorted((DATA / base).iterdir())
    if p.is_dir()
][::3]  # a few of each kind
pytestmark = pytest.mark.skipif(not PLAIN, reason="no DeepSpeed fixtures (run fixtures/generate_deepspeed.py)")


def _per_param_optimizer(key: str) -> bool:
    return key.startswith("optim.state.")


def _same_objects(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key, o in a.items():
        assert (o.path, repr(o.data), o.location, o.attrs) == (
            b[key].path,
            repr(b[key].data),
            b[key].location,
            b[key].attrs,
        ), key


@pytest.mark.parametrize("path", PLAIN, ids=lambda p: p.name)
def test_index_without_optimizer_is_the_full_one_less_what_it_counts(path):
    full = open_checkpoint(str(path)).index
    lean = open_checkpoint(str(path), optimizer=False).index
    left_tensors = [k for k in full.tensors if _per_param_optimizer(k)]
    left_values = [k for k in full.objects if _per_param_optimizer(k)]
    assert left_tensors, "the fixture has optimizer state: the test would prove nothing"
    assert lean.tensors == {k: e for k, e in full.tensors.items() if not _per_param_optimizer(k)}
    assert list(lean.tensors) == [k for k in full.tensors if not _per_param_optimizer(k)]  # same order
    _same_objects(lean.objects, {k: o for k, o in full.objects.items() if not _per_param_optimizer(k)})
    assert lean.metadata.pop(UNINDEXED_OPTIMIZER) == {"tensors": len(left_tensors), "values": len(left_values)}
    assert lean.metadata == full.metadata and UNINDEXED_OPTIMIZER not in full.metadata
    assert (lean.files, lean.checks, lean.step, lean.world_size) == (
        full.files,
        full.checks,
        full.step,
        full.world_size,
    )


@pytest.mark.parametrize("path", OTHER, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_tp_expert_and_pipeline_checkpoints_are_indexed_whole_regardless(path):
    full = open_checkpoint(str(path)).index
    lean = open_checkpoint(str(path), optimizer=False).index
    assert any(_per_param_optimizer(k) for k in full.tensors)
    assert lean.tensors == full.tensors and lean.metadata == full.metadata
    _same_objects(lean.objects, full.objects)


@pytest.mark.parametrize("path", PLAIN[::2], ids=lambda p: p.name)
def test_consolidate_says_what_the_full_index_holds_and_is_not_written(tmp_path, path):
    split = split_roles(open_checkpoint(str(path)).index)
    result = consolidate(str(path), str(tmp_path / "out"))
    assert (
        f"not written: {len(split.optim)} optimizer tensors and {len(split.optim_objects)} optimizer values "
        f"(add --include-optimizer)"
    ) in result.not_written
    assert result.optimizer_tensors == 0 and result.model_tensors == len(split.model)


def _one_sentence(args: list[str]) -> str:
    from ckptkit_cli.main import cli

    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    return lines[0]


def test_optimizer_state_damage_is_refused_by_consolidate_as_by_inspect(monkeypatch, tmp_path):
    """Rank 1 lacks a key rank 0 has: refused in the same sentence whether or not the entries
    are indexed (the check is the group's, made before any per-parameter entry)."""
    from ckptkit.formats.deepspeed import reader

    path = next((p for p in PLAIN if p.name == "z3_bf16_w2"), PLAIN[0])
    real = reader.load_structure

    def rank1_without_exp_avg_sq(archive, eager=False, **kwargs):
        structure = real(archive, eager=eager, **kwargs)
        osd = structure.get("optimizer_state_dict") if isinstance(structure, dict) else None
        if not isinstance(osd, dict) or "zero_pp_rank_1_" not in archive.label:
            return structure
        # a changed copy: ranks that pickle alike share one structure (torch_archive.LastStructure)
        inner_key = "base_optimizer_state" if "base_optimizer_state" in osd else "optimizer_state_dict"
        inner = osd[inner_key]
        state = {g: {k: v for k, v in s.items() if k != "exp_avg_sq"} for g, s in inner["state"].items()}
        return {**structure, "optimizer_state_dict": {**osd, inner_key: {**inner, "state": state}}}

    monkeypatch.setattr(reader, "load_structure", rank1_without_exp_avg_sq)
    said = _one_sentence(["inspect", str(path)])
    assert "every rank's must match" in said and "optim_states.pt" in said
    assert _one_sentence(["consolidate", str(path), str(tmp_path / "out")]) == said
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", PLAIN[::3], ids=lambda p: p.name)
def test_flat_pieces_equal_and_hash_like_those_their_constructors_make(path):
    """flat_groups makes the per-parameter FlatRange/Location/Piece without their __init__: each
    must be the very value the constructors give (equal, same hash, same repr)."""
    from ckptkit.index.types import FlatRange, Location, Piece

    index = open_checkpoint(str(path)).index
    flat = [p for e in index.tensors.values() for p in e.pieces if type(p.region) is FlatRange]
    assert flat
    for p in flat:
        loc = p.location
        made = Piece(FlatRange(p.region.start, p.region.length), Location(loc.file, loc.offset, loc.length))
        assert p == made and hash(p) == hash(made) and repr(p) == repr(made)
