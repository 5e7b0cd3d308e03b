"""The exact text of representative error messages, pinned (as safetensors' tests pin theirs).

One table: each case crafts a bad input in tmp_path from the real fixtures, runs one command line
in process, and asserts the exit status and the WHOLE of stderr, character for character, once the
temporary folder is written `<tmp>` (and a lock holder's pid `<pid>`). The other bad-input tests
check that a message names the right things; this one notices any change of wording at all, so a
refactor that keeps the sentences keeps this test green, and one that changes a sentence has to
change it here, on purpose. Every error class the CLI reports is here: usage mistakes, paths that
are not checkpoints, malformed files, refused pickles, unsupported state, output problems, and
verify's and diff's reports. A bug (exit 3) is not: its text is a traceback under --debug.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner

from helpers.corrupt import (
    DATA,
    copy_fixture,
    good_header,
    load_md,
    replace_storage,
    save_md,
    set_tensor_size,
    sharded_safetensors,
    storage_key,
    truncate_half,
    write_safetensors_raw,
)


@dataclass(frozen=True)
class Case:
    """One command line on one crafted input, and everything it must print on stderr."""

    id: str
    build: Callable[[Path], list[str]]  # crafts the input under tmp; the command line to run
    code: int
    stderr: str  # the whole of stderr, the tmp folder written <tmp>
    stdout: str | None = None  # the whole of stdout when it is the report (verify, diff)


# ---- inputs -------------------------------------------------------------------------------------


def dcp(tmp: Path) -> Path:
    return copy_fixture("fsdp2_w2", tmp, "ckpt")


def deepspeed(tmp: Path) -> Path:
    return copy_fixture("deepspeed/z2_fp32_w2", tmp, "ds")


def safetensors_file(tmp: Path, edit: Callable[[dict], None]) -> Path:
    """model.safetensors holding the two-tensor good header, once `edit` has changed the header."""
    header, data = good_header()
    edit(header)
    path = tmp / "model.safetensors"
    write_safetensors_raw(path, header, data)
    return path


def hf_output_dir_none_complete(tmp: Path) -> Path:
    """A Trainer output_dir whose two checkpoints both lack trainer_state.json (killed saves)."""
    out = tmp / "output_dir"
    for n in (1, 2):
        ckpt = out / f"checkpoint-{n}"
        shutil.copytree(DATA / "trainer" / "ddp" / "checkpoint-2", ckpt)
        (ckpt / "trainer_state.json").unlink()
    return out


def forbidden_global_pickle() -> bytes:
    """A protocol-2 pickle calling os.system('true') (never run: the unpickler refuses the global)."""
    return b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R."


def torch_save_with_adafactor_state(tmp: Path) -> Path:
    """A model + optimizer torch.save file whose optimizer keeps Adafactor's factored moment."""
    path = tmp / "adafactor.pt"
    torch.save(
        {
            "model": {"w": torch.ones(2, 3)},
            "optim": {
                "state": {"w": {"step": torch.tensor(1.0), "exp_avg_sq_row": torch.ones(2)}},
                "param_groups": [{"params": ["w"], "lr": 0.1}],
            },
        },
        path,
    )
    return path


def dcp_edit(tmp: Path, edit: Callable[[object], None]) -> Path:
    d = dcp(tmp)
    md = load_md(d)
    edit(md)
    save_md(d, md)
    return d


# ---- builders: each returns the command line ------------------------------------------------------


def _missing_path(tmp: Path) -> list[str]:
    return ["inspect", str(tmp / "does_not_exist")]


def _empty_folder(tmp: Path) -> list[str]:
    (tmp / "empty").mkdir()
    return ["inspect", str(tmp / "empty")]


def _unrelated_folder(tmp: Path) -> list[str]:
    d = tmp / "stuff"
    (d / "logs").mkdir(parents=True)
    (d / "notes.txt").write_text("hello\n")
    return ["inspect", str(d)]


def _two_torch_save_files(tmp: Path) -> list[str]:
    d = tmp / "two"
    d.mkdir()
    for name in ("a.pt", "b.pt"):
        shutil.copy(DATA / "plain_state_dict.pt", d / name)
    return ["inspect", str(d)]


def _random_pt(tmp: Path) -> list[str]:
    (tmp / "x.pt").write_bytes(b"\x17\x42" + bytes(range(256)) * 4)
    return ["inspect", str(tmp / "x.pt")]


def _truncated_distcp(tmp: Path) -> list[str]:
    d = dcp(tmp)
    truncate_half(d / "__0_0.distcp")
    return ["consolidate", str(d), str(tmp / "OUT")]


def _zip_not_torch_save(tmp: Path) -> list[str]:
    with zipfile.ZipFile(tmp / "notes.pt", "w") as zf:
        zf.writestr("readme.txt", "just a zip\n")
    return ["inspect", str(tmp / "notes.pt")]


def _legacy_torch_save(tmp: Path) -> list[str]:
    torch.save({"w": torch.ones(3)}, tmp / "legacy.pt", _use_new_zipfile_serialization=False)
    return ["inspect", str(tmp / "legacy.pt")]


def _dcp_missing_metadata(tmp: Path) -> list[str]:
    d = dcp(tmp)
    (d / ".metadata").unlink()
    return ["inspect", str(d)]


def _dcp_truncated_metadata(tmp: Path) -> list[str]:
    d = dcp(tmp)
    truncate_half(d / ".metadata")
    return ["inspect", str(d)]


def _dcp_metadata_not_metadata(tmp: Path) -> list[str]:
    d = dcp(tmp)
    (d / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": 1}))
    return ["inspect", str(d)]


def _dcp_missing_rank_file(tmp: Path) -> list[str]:
    d = dcp(tmp)
    (d / "__1_0.distcp").unlink()
    return ["reshard", str(d), str(tmp / "OUT"), "--to", "3"]


def _dcp_record_past_end(tmp: Path) -> list[str]:
    d = dcp(tmp)
    md = load_md(d)
    mi = storage_key(md, "model.embed.weight", (19, 0))
    replace_storage(md, mi, offset=(d / md.storage_data[mi].relative_path).stat().st_size - 10)
    save_md(d, md)
    return ["inspect", str(d)]


def _dcp_relpath_outside(tmp: Path) -> list[str]:
    d = dcp_edit(
        tmp, lambda md: replace_storage(md, storage_key(md, "model.pos", (0, 0)), relative_path="../../etc/passwd")
    )
    return ["consolidate", str(d), str(tmp / "OUT")]


def _dcp_link_outside(tmp: Path) -> list[str]:
    d = dcp(tmp)
    outside = tmp / "elsewhere.distcp"
    (d / "__1_0.distcp").rename(outside)
    (d / "__1_0.distcp").symlink_to(outside)
    return ["inspect", str(d)]


def _dcp_forbidden_global(tmp: Path) -> list[str]:
    d = dcp(tmp)
    (d / ".metadata").write_bytes(forbidden_global_pickle())
    return ["inspect", str(d)]


def _dcp_not_tiled(tmp: Path) -> list[str]:
    d = dcp_edit(tmp, lambda md: set_tensor_size(md, "model.pos", (6, 10)))
    return ["consolidate", str(d), str(tmp / "OUT")]


def _verify_not_tiled(tmp: Path) -> list[str]:
    d = dcp_edit(tmp, lambda md: set_tensor_size(md, "model.pos", (6, 10)))
    return ["verify", str(d)]


def _st_too_short(tmp: Path) -> list[str]:
    (tmp / "model.safetensors").write_bytes(b"\x01\x02\x03")
    return ["inspect", str(tmp / "model.safetensors")]


def _st_header_too_long(tmp: Path) -> list[str]:
    header, data = good_header()
    write_safetensors_raw(tmp / "model.safetensors", header, data, header_len=10**6)
    return ["inspect", str(tmp / "model.safetensors")]


def _st_header_not_json(tmp: Path) -> list[str]:
    write_safetensors_raw(tmp / "model.safetensors", b"{not json" + b" " * 7, b"")
    return ["inspect", str(tmp / "model.safetensors")]


def _st_offsets_past_end(tmp: Path) -> list[str]:
    def edit(h: dict) -> None:
        h["b"]["data_offsets"] = [24, 1000]

    return ["inspect", str(safetensors_file(tmp, edit))]


def _st_overlap(tmp: Path) -> list[str]:
    def edit(h: dict) -> None:
        h["b"] = {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}

    return ["consolidate", str(safetensors_file(tmp, edit)), str(tmp / "OUT")]


def _st_unknown_dtype(tmp: Path) -> list[str]:
    def edit(h: dict) -> None:
        h["a"]["dtype"] = "Q7"

    return ["inspect", str(safetensors_file(tmp, edit))]


def _st_dtype_shape_mismatch(tmp: Path) -> list[str]:
    def edit(h: dict) -> None:
        h["a"]["dtype"] = "F64"

    return ["inspect", str(safetensors_file(tmp, edit))]


def _st_missing_shard(tmp: Path) -> list[str]:
    d = sharded_safetensors(tmp)
    (d / "model-00002-of-00002.safetensors").unlink()
    return ["inspect", str(d)]


def _st_index_names_absent_tensor(tmp: Path) -> list[str]:
    d = sharded_safetensors(tmp)
    doc = json.loads((d / "model.safetensors.index.json").read_text())
    doc["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(doc))
    return ["inspect", str(d)]


def _ds_bad_latest(tmp: Path) -> list[str]:
    d = deepspeed(tmp)
    (d / "latest").write_text("global_step9")
    return ["inspect", str(d)]


def _mcore_legacy_rank_file(tmp: Path) -> list[str]:
    d = copy_fixture("mcore/legacy_tp2", tmp, "legacy")
    return ["inspect", str(d / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")]


def _mcore_convert_flat_buffers(tmp: Path) -> list[str]:
    d = copy_fixture("mcore/tp2dp2_distopt", tmp, "save")
    return ["convert", str(d), str(tmp / "out"), "--to", "dcp"]


def _mcore_latest_missing(tmp: Path) -> list[str]:
    d = copy_fixture("mcore/pp2_tied", tmp, "save")
    (d / "latest_checkpointed_iteration.txt").write_text("7")
    return ["inspect", str(d)]


def _mcore_reshard_dp_reshardable(tmp: Path) -> list[str]:
    d = copy_fixture("mcore/tp2dp2_distopt", tmp, "save")
    return ["reshard", str(d), str(tmp / "out"), "--to", "tp=1,pp=1"]


def _mcore_reshard_world_size(tmp: Path) -> list[str]:
    d = copy_fixture("mcore/pp2_tied", tmp, "save")
    return ["reshard", str(d), str(tmp / "out"), "--to", "2"]


def _ds_missing_optim_file(tmp: Path) -> list[str]:
    d = deepspeed(tmp)
    (d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    return ["consolidate", str(d), str(tmp / "OUT")]


def _ds_tag_missing(tmp: Path) -> list[str]:
    return ["inspect", str(deepspeed(tmp)), "--tag", "global_step7"]


def _tag_on_dcp(tmp: Path) -> list[str]:
    return ["inspect", str(dcp(tmp)), "--tag", "global_step2"]


def _run_folder_none_complete(tmp: Path) -> list[str]:
    return ["inspect", str(hf_output_dir_none_complete(tmp))]


def _reshard_to_zero(tmp: Path) -> list[str]:
    return ["reshard", str(dcp(tmp)), str(tmp / "OUT"), "--to", "0"]


def _reshard_to_too_many(tmp: Path) -> list[str]:
    return ["reshard", str(dcp(tmp)), str(tmp / "OUT"), "--to", "mesh=dp_shard:1048576,tp:2"]


def _convert_too_many(tmp: Path) -> list[str]:
    return ["convert", str(dcp(tmp)), str(tmp / "OUT"), "--to", "fsdp2", "--world-size", "99999999999"]


def _reshard_wrong_from(tmp: Path) -> list[str]:
    return ["reshard", str(dcp(tmp)), str(tmp / "OUT"), "--to", "4", "--from", "3"]


def _reshard_torch_save(tmp: Path) -> list[str]:
    return ["reshard", str(copy_fixture("plain_state_dict.pt", tmp)), str(tmp / "OUT"), "--to", "2"]


def _bad_dtype(tmp: Path) -> list[str]:
    return ["consolidate", str(dcp(tmp)), str(tmp / "OUT"), "--dtype", "int8"]


def _bad_shard_size(tmp: Path) -> list[str]:
    return ["consolidate", str(dcp(tmp)), str(tmp / "OUT"), "--max-shard-size", "5XB"]


def _bad_memory_budget(tmp: Path) -> list[str]:
    return ["verify", str(dcp(tmp)), "--memory-budget", "banana"]


def _torch_save_cut_short(tmp: Path) -> list[str]:
    path = copy_fixture("plain_state_dict.pt", tmp)
    truncate_half(path)
    return ["consolidate", str(path), str(tmp / "OUT")]


def _convert_bad_to(tmp: Path) -> list[str]:
    return ["convert", str(dcp(tmp)), str(tmp / "OUT"), "--to", "banana"]


def _convert_wrong_from(tmp: Path) -> list[str]:
    return ["convert", str(dcp(tmp)), str(tmp / "OUT"), "--to", "torch", "--from", "deepspeed"]


def _convert_zero_without_config(tmp: Path) -> list[str]:
    return ["convert", str(dcp(tmp)), str(tmp / "OUT"), "--to", "zero2"]


def _convert_unmappable_state(tmp: Path) -> list[str]:
    return ["convert", str(torch_save_with_adafactor_state(tmp)), str(tmp / "OUT"), "--to", "dcp"]


def _out_exists(tmp: Path) -> list[str]:
    (tmp / "OUT").mkdir()
    (tmp / "OUT" / "keep.txt").write_text("precious")
    return ["consolidate", str(dcp(tmp)), str(tmp / "OUT")]


def _out_is_a_file(tmp: Path) -> list[str]:
    (tmp / "OUT").write_text("precious")
    return ["reshard", str(dcp(tmp)), str(tmp / "OUT"), "--to", "3"]


def _out_parent_missing(tmp: Path) -> list[str]:
    return ["consolidate", str(dcp(tmp)), str(tmp / "no" / "such" / "OUT")]


def _out_inside_source(tmp: Path) -> list[str]:
    d = dcp(tmp)
    return ["consolidate", str(d), str(d / "OUT")]


def _out_locked(tmp: Path) -> list[str]:
    (tmp / ".OUT.ckptkit-lock").write_text(str(os.getpid()))  # a live process holds it
    return ["consolidate", str(dcp(tmp)), str(tmp / "OUT")]


def _diff_different_models(tmp: Path) -> list[str]:
    return [
        "diff",
        "-q",
        "--model-only",
        str(copy_fixture("plain_state_dict.pt", tmp)),
        str(copy_fixture("fsdp1_full_state_dict.pt", tmp)),
    ]


def _grow_tp_without_rules(tmp: Path) -> list[str]:
    src = copy_fixture("ds_grow_tp/moe/moetp_z2_fp32_tp1_ep2_w2", tmp, "moe")
    return ["reshard", str(src), str(tmp / "OUT"), "--to", "tp=2,ep=2,dp=2"]


def _grow_tp_rule_names_a_missing_parameter(tmp: Path) -> list[str]:
    src = copy_fixture("ds_grow_tp/pp/pp2_tp1_dp2_z1_fp32", tmp, "pp")
    rules = tmp / "rules.json"
    rules.write_text('{"rules": [{"pattern": "module.0.word_embeddings.weight", "split": 0}]}')
    return ["reshard", str(src), str(tmp / "OUT"), "--to", "tp=2,pp=2,dp=1", "--tp-rules", str(rules)]


# how every "not a checkpoint ckptkit recognises" message ends
RECOGNISED = (
    "a DCP checkpoint (.metadata), a DeepSpeed save (`latest` or ZeRO rank files), *.safetensors, "
    "one torch.save file (.pt, .pth, .bin, .ckpt, .tar), accelerate's pytorch_model_fsdp_N/, or a "
    "run folder holding checkpoint-N/ (HF Trainer output_dir), step_N/ (ckptkit Checkpointer), "
    "DeepSpeed tag folders (global_stepN/) or *.ckpt (Lightning checkpoints/)\n"
)

# ---- the table --------------------------------------------------------------------------------

CASES: list[Case] = [
    # paths that are not checkpoints (NotACheckpointError)
    Case("missing_path", _missing_path, 2, "error: <tmp>/does_not_exist: no such file or folder\n"),
    Case(
        "empty_folder",
        _empty_folder,
        2,
        "error: <tmp>/empty: not a checkpoint ckptkit recognises; the folder is empty. Recognised: " + RECOGNISED,
    ),
    Case(
        "unrelated_folder",
        _unrelated_folder,
        2,
        "error: <tmp>/stuff: not a checkpoint ckptkit recognises; found 2 entries (logs/, notes.txt). "
        "Recognised: " + RECOGNISED,
    ),
    Case(
        "two_torch_save_files",
        _two_torch_save_files,
        2,
        "error: <tmp>/two: not a checkpoint ckptkit recognises; found 2 torch.save files (a.pt, b.pt): "
        "name the one to read. Recognised: " + RECOGNISED,
    ),
    Case("random_pt", _random_pt, 2, "error: <tmp>/x.pt: not a torch.save archive (no zip header at offset 0)\n"),
    Case(
        "run_folder_none_complete",
        _run_folder_none_complete,
        2,
        "error: <tmp>/output_dir: a HF Trainer output folder with 2 checkpoint(s), none complete "
        "(checkpoint-2: no trainer_state.json (the Trainer writes it last); checkpoint-1: no "
        "trainer_state.json (the Trainer writes it last))\n",
    ),
    # malformed files (FormatError)
    Case(
        "truncated_distcp",
        _truncated_distcp,
        2,
        "error: <tmp>/ckpt/__0_0.distcp: item of optim.state.embed.weight.exp_avg at bytes 23934..26215 "
        "lies past the end of the file (23966 bytes; truncated?)\n",
    ),
    Case(
        "zip_not_torch_save",
        _zip_not_torch_save,
        2,
        "error: <tmp>/notes.pt: torch.save archive must hold exactly one <root>/data.pkl, found 0\n",
    ),
    Case(
        "legacy_torch_save",
        _legacy_torch_save,
        2,
        "error: <tmp>/legacy.pt: legacy (pre-1.6, non-zip) torch.save format is not supported; re-save "
        "it with a current torch\n",
    ),
    Case(
        "dcp_missing_metadata",
        _dcp_missing_metadata,
        2,
        "error: <tmp>/ckpt: has .distcp data files but no .metadata: an incomplete DCP checkpoint (the "
        "save did not finish)\n",
    ),
    Case(
        "dcp_truncated_metadata",
        _dcp_truncated_metadata,
        2,
        "error: <tmp>/ckpt/.metadata: pickle declares a frame of 19,947 bytes at byte 2, past the end of "
        "its 9,979 bytes\n",
    ),
    Case(
        "dcp_metadata_not_metadata",
        _dcp_metadata_not_metadata,
        2,
        "error: <tmp>/ckpt/.metadata: not a DCP Metadata object (found dict)\n",
    ),
    Case(
        "dcp_missing_rank_file",
        _dcp_missing_rank_file,
        2,
        "error: <tmp>/ckpt/__1_0.distcp: cannot read it (file is missing)\n",
    ),
    Case(
        "dcp_record_past_end",
        _dcp_record_past_end,
        2,
        "error: <tmp>/ckpt/__1_0.distcp: item of model.embed.weight at bytes 100637..102918 lies past "
        "the end of the file (100647 bytes; truncated?)\n",
    ),
    Case(
        "dcp_relpath_outside",
        _dcp_relpath_outside,
        2,
        "error: <tmp>/ckpt (storage record of model.pos): storage record points outside the checkpoint "
        "folder ('../../etc/passwd')\n",
    ),
    Case(
        "dcp_link_outside",
        _dcp_link_outside,
        2,
        "error: <tmp>/ckpt/__1_0.distcp: is a link leading to '<tmp>/elsewhere.distcp', outside the "
        "checkpoint <tmp>/ckpt; refused: pass --follow-links (or set CKPTKIT_FOLLOW_LINKS=1) to read it "
        "anyway\n",
    ),
    Case(
        "dcp_not_tiled",
        _dcp_not_tiled,
        2,
        "error: <tmp>/ckpt: tensor model.pos [6, 10] is not tiled exactly by its pieces: 10 element(s) "
        "are in no piece (e.g. offsets [5, 0] sizes [1, 10]); run `ckptkit verify` for all problems\n",
    ),
    Case(
        "st_too_short",
        _st_too_short,
        2,
        "error: <tmp>/model.safetensors: 3 bytes is too short for a safetensors file\n",
    ),
    Case(
        "st_header_too_long",
        _st_header_too_long,
        2,
        "error: <tmp>/model.safetensors: header length 1000000 does not fit the file (176 bytes)\n",
    ),
    Case(
        "st_header_not_json",
        _st_header_not_json,
        2,
        "error: <tmp>/model.safetensors: header is not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))\n",
    ),
    Case(
        "st_offsets_past_end",
        _st_offsets_past_end,
        2,
        "error: <tmp>/model.safetensors: tensor b data_offsets [24, 1000] lie outside the 40-byte data buffer\n",
    ),
    Case("st_overlap", _st_overlap, 2, "error: <tmp>/model.safetensors: tensors a and b overlap in the data buffer\n"),
    Case(
        "st_unknown_dtype", _st_unknown_dtype, 2, "error: <tmp>/model.safetensors: tensor a has an unknown dtype 'Q7'\n"
    ),
    Case(
        "st_dtype_shape_mismatch",
        _st_dtype_shape_mismatch,
        2,
        "error: <tmp>/model.safetensors: tensor a is float64[2, 3] (48 bytes) but its data_offsets span 24 bytes\n",
    ),
    Case(
        "st_missing_shard",
        _st_missing_shard,
        2,
        "error: <tmp>/hf/model-00002-of-00002.safetensors: shard listed in model.safetensors.index.json is missing\n",
    ),
    Case(
        "st_index_names_absent_tensor",
        _st_index_names_absent_tensor,
        2,
        "error: <tmp>/hf/model.safetensors.index.json: tensor c is mapped to "
        "model-00001-of-00002.safetensors, which does not contain it\n",
    ),
    Case(
        "ds_bad_latest",
        _ds_bad_latest,
        2,
        "error: <tmp>/ds: tag folder is missing ('global_step9', named by `latest` or --tag)\n",
    ),
    Case(
        "mcore_legacy_rank_file",
        _mcore_legacy_rank_file,
        2,
        "error: <tmp>/legacy/iter_0000002/mp_rank_00/model_optim_rng.pt: is one rank's part of a Megatron-LM "
        "checkpoint saved at tp 2 x pp 1 x ep 1 x dp 1 (its args say tensor_model_parallel_size=2, "
        "pipeline_model_parallel_size=1), not the whole model; give ckptkit the iteration folder holding every "
        "rank's mp_rank_* folder (or the save folder above it), which it reads as one checkpoint\n",
    ),
    Case(
        "mcore_convert_flat_buffers",
        _mcore_convert_flat_buffers,
        2,
        "error: <tmp>/save: its optimizer state is the distributed optimizer's dp_reshardable flat buffers "
        "(6 tensors), laid out by MCore's grad buffers, which the checkpoint does not record per parameter, so "
        "it cannot be mapped to parameters; resave it with --dist-ckpt-optim-fully-reshardable, or convert the "
        "model alone (--model-only)\n",
    ),
    Case(
        "mcore_latest_missing",
        _mcore_latest_missing,
        2,
        "error: <tmp>/save/iter_0000007: the iteration latest_checkpointed_iteration.txt names is not there "
        "(iterations: iter_0000002)\n",
    ),
    Case(
        "mcore_reshard_dp_reshardable",
        _mcore_reshard_dp_reshardable,
        2,
        "error: <tmp>/save: its distributed optimizer was saved dp_reshardable (flat per-bucket buffers laid out "
        "for tp=2,pp=1,ep=1,dp=2), which ckptkit cannot lay out for tp=1,pp=1,ep=1,dp=1; resave it with "
        "--dist-ckpt-optim-fully-reshardable, or reshard the model alone with --model-only\n",
    ),
    Case(
        "mcore_reshard_world_size",
        _mcore_reshard_world_size,
        2,
        "error: <tmp>/save: a Megatron-Core checkpoint is laid out by tensor, pipeline and data parallel sizes, "
        "not a world size: give them, --to tp=T,pp=P[,dp=D]\n",
    ),
    Case(
        "ds_missing_optim_file",
        _ds_missing_optim_file,
        2,
        "error: <tmp>/ds/global_step2/mp_rank_00_model_states.pt: says dp_world_size 2, but the "
        "optim-states file of rank 1 is missing (zero_pp_rank_1_mp_rank_00_optim_states.pt)\n",
    ),
    Case(
        "ds_tag_missing",
        _ds_tag_missing,
        2,
        "error: <tmp>/ds: tag folder is missing ('global_step7', named by `latest` or --tag)\n",
    ),
    # a pickle that would run code (UnsafePickleError)
    Case(
        "dcp_forbidden_global",
        _dcp_forbidden_global,
        2,
        "error: <tmp>/ckpt/.metadata: refusing to unpickle global 'os.system' (not on ckptkit's "
        "allowlist; nothing was executed)\n",
    ),
    # options that contradict each other or the checkpoint (UsageError, click's own errors)
    Case("tag_on_dcp", _tag_on_dcp, 2, "error: <tmp>/ckpt: --tag is for DeepSpeed checkpoints, and this is not one\n"),
    Case("reshard_to_zero", _reshard_to_zero, 2, "error: --to must be at least 1 (got 0)\n"),
    Case(
        "reshard_to_too_many",
        _reshard_to_too_many,
        2,
        "error: --to mesh=dp_shard:1048576,tp:2 asks for 2097152 ranks; ckptkit writes checkpoints for at most "
        "1048576 ranks (one or more files each)\n",
    ),
    Case(
        "convert_too_many",
        _convert_too_many,
        2,
        "error: --world-size 99999999999 asks for 99999999999 ranks; ckptkit writes checkpoints for at most "
        "1048576 ranks (one or more files each)\n",
    ),
    Case(
        "reshard_wrong_from", _reshard_wrong_from, 2, "error: <tmp>/ckpt: was saved at world size 2, not 3 (--from)\n"
    ),
    Case("bad_dtype", _bad_dtype, 2, "error: --dtype 'int8' is not a floating dtype (use fp32, bf16 or fp16)\n"),
    Case(
        "bad_shard_size",
        _bad_shard_size,
        2,
        "error: --max-shard-size: cannot read size '5XB' (use e.g. 5GB, 500MB, 2GiB)\n",
    ),
    Case(
        "bad_memory_budget",
        _bad_memory_budget,
        2,
        "error: --memory-budget: cannot read size 'banana' (use e.g. 5GB, 500MB, 2GiB)\n",
    ),
    Case(
        "torch_save_cut_short",
        _torch_save_cut_short,
        2,
        "error: <tmp>/plain_state_dict.pt: damaged torch.save archive: its zip directory cannot be read "
        "(the file may be cut short): File is not a zip file\n",
    ),
    Case(
        "convert_bad_to",
        _convert_bad_to,
        2,
        "Usage: ckptkit convert [OPTIONS] SRC OUT\n"
        "Try 'ckptkit convert --help' for help.\n"
        "\n"
        "Error: Invalid value for '--to': 'banana' is not one of 'dcp', 'fsdp', 'fsdp2', 'deepspeed', "
        "'zero1', 'zero2', 'zero3', 'torch', 'safetensors', 'hf', 'ds-universal'.\n",
    ),
    Case(
        "convert_wrong_from", _convert_wrong_from, 2, "error: <tmp>/ckpt: is a dcp checkpoint, not deepspeed (--from)\n"
    ),
    Case(
        "convert_zero_without_config",
        _convert_zero_without_config,
        2,
        "error: --to zero2 needs --ds-config CONFIG.json: the DeepSpeed config the job will load with "
        "(stage, precision and sub_group_size decide the layout)\n",
    ),
    # valid input ckptkit does not support (UnsupportedError)
    Case(
        "reshard_torch_save",
        _reshard_torch_save,
        2,
        "error: <tmp>/plain_state_dict.pt: a torch_save checkpoint is not sharded by world size, so "
        "there is nothing to reshard (reshard takes a DCP folder or a DeepSpeed checkpoint)\n",
    ),
    Case(
        "convert_unmappable_state",
        _convert_unmappable_state,
        2,
        "error: <tmp>/adafactor.pt (optim.state.w.exp_avg_sq_row): optimizer state 'exp_avg_sq_row' "
        "cannot be mapped: Adafactor's factored second moment (row and column factors of a 2-D "
        "parameter), which is not elementwise with the parameter: no shard or flat partition of the "
        "parameter says which part of the factors goes with it\n",
    ),
    # adding tensor parallelism to a DeepSpeed checkpoint saved without it
    Case(
        "grow_tp_without_rules",
        _grow_tp_without_rules,
        2,
        "error: --to tp=2,ep=2,dp=2: adding tensor parallelism to the mixture-of-experts checkpoint "
        "<tmp>/moe is not supported yet (give ep=...,dp=... with tp=1,pp=1); to add it, give --tp-rules "
        "FILE saying how the model built at that tp splits each parameter (the checkpoint, saved without "
        "tp, cannot say; see docs/tp_rules.md)\n",
    ),
    Case(
        "grow_tp_rule_names_a_missing_parameter",
        _grow_tp_rule_names_a_missing_parameter,
        2,
        "error: --tp-rules '<tmp>/rules.json': rule 'module.0.word_embeddings.weight' names a parameter "
        "<tmp>/pp does not have (its parameters are named like '0.word_embeddings.weight')\n",
    ),
    # the output cannot be written (OutputError)
    Case(
        "out_exists",
        _out_exists,
        2,
        "error: <tmp>/OUT: output already exists (choose another path or pass --overwrite)\n",
    ),
    Case(
        "out_is_a_file",
        _out_is_a_file,
        2,
        "error: <tmp>/OUT: output already exists (choose another path or pass --overwrite)\n",
    ),
    Case(
        "out_parent_missing",
        _out_parent_missing,
        2,
        "error: <tmp>/no/such/OUT: parent folder <tmp>/no/such does not exist\n",
    ),
    Case(
        "out_inside_source",
        _out_inside_source,
        2,
        "error: <tmp>/ckpt/OUT: this output is inside the source <tmp>/ckpt, and ckptkit never writes "
        "over or into its source; choose an OUT outside it\n",
    ),
    Case(
        "out_locked",
        _out_locked,
        2,
        "error: <tmp>/OUT: another ckptkit run is writing this output (lock <tmp>/.OUT.ckptkit-lock, pid "
        "<pid>); wait for it or remove the lock\n",
    ),
    # reports: problems found (exit 1)
    Case(
        "verify_not_tiled",
        _verify_not_tiled,
        1,
        "<tmp>/ckpt: 1 problem(s) found\n"
        "  - coverage_gap: tensor model.pos [6, 10]: 10 element(s) are in no piece, e.g. offsets [5, 0] "
        "sizes [1, 10]\n",
        stdout="",
    ),
    Case(
        "diff_different_models",
        _diff_different_models,
        1,
        "",
        stdout="a: <tmp>/plain_state_dict.pt\n"
        "b: <tmp>/fsdp1_full_state_dict.pt\n"
        "compared 1 different, 12 equal, 3 missing_b\n"
        "  missing_b extra_bf16  only in <tmp>/plain_state_dict.pt\n"
        "  missing_b extra_scalar  only in <tmp>/plain_state_dict.pt\n"
        "  missing_b extra_transposed  only in <tmp>/plain_state_dict.pt\n"
        "  different norm.bias  max |a-b| 3.72529e-09  rel L2 7.81738e-08\n"
        "not equal\n",
    ),
]


def run(args: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `ckptkit ARGS` in process, named `ckptkit` as the entry point is."""
    from ckptkit_cli.main import cli

    res = CliRunner().invoke(cli, args, prog_name="ckptkit")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"ckptkit {' '.join(args)} raised {res.exception!r}") from res.exception
    return res.exit_code, res.stdout, res.stderr


def normalised(text: str, tmp: Path) -> str:
    """`text` with the tmp folder written <tmp> and this process's pid (a lock's holder) <pid>."""
    for folder in (str(tmp.resolve()), str(tmp)):
        text = text.replace(folder, "<tmp>")
    return text.replace(f"pid {os.getpid()})", "pid <pid>)")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_error_message(case: Case, tmp_path: Path) -> None:
    args = case.build(tmp_path)
    code, stdout, stderr = run(args)
    detail = f"ckptkit {' '.join(args)}\nexit {code}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    assert "Traceback" not in stdout + stderr, detail
    assert code == case.code, detail
    assert normalised(stderr, tmp_path) == case.stderr, detail
    if case.stdout is not None:
        assert normalised(stdout, tmp_path) == case.stdout, detail


def test_every_case_has_its_own_id() -> None:
    assert len({c.id for c in CASES}) == len(CASES)
