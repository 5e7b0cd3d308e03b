"""Pin the bytes that consolidate, reshard and convert write for the committed fixtures.

Refactors of the readers, writers and planner promise outputs that stay byte-identical. This script runs a
representative set of commands (each fixture family, a few
targets each) in-process and records a SHA-256 per output file. `tests/test_output_digests.py`
recomputes them and names the output that changed. The bytes depend on neither the worker count
nor the memory budget (checked with CKPTKIT_WORKERS=1/16, CKPTKIT_MEMORY_BUDGET=2MiB), nor on the
output's path. Regenerate only on purpose:

    .venv/bin/python tests/helpers/pin_outputs.py       # rewrites tests/data/output_digests.json
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "fixtures" / "data"
DIGESTS = ROOT / "tests" / "data" / "output_digests.json"

# Files whose bytes are not a function of the input. None today: the torch.save writer stamps a
# fixed zip date, the DCP writer derives its metadata uuid from the plan (uuid5), temporary names
# (uuid4 tokens) never reach a committed output. Name a file here only if a writer must stamp time.
SKIP_NAMES: frozenset[str] = frozenset()

# (case id, fixture path relative to fixtures/data, ckptkit arguments after SRC OUT).
CASES: list[tuple[str, str, list[str]]] = [
    # DCP / FSDP2
    ("fsdp2_w2.consolidate", "fsdp2_w2", ["consolidate", "--include-optimizer"]),
    ("fsdp2_w2.reshard3", "fsdp2_w2", ["reshard", "--to", "3"]),
    (
        "fsdp2_w2.to_zero3",
        "fsdp2_w2",
        ["convert", "--to", "zero3", "--world-size", "2", "--ds-config", "deepspeed/z3_bf16_w2/ds_config.json"],
    ),
    ("fsdp2_w3.to_torch", "fsdp2_w3", ["convert", "--to", "torch"]),
    (
        "fsdp2_sgd_w2.to_zero2",
        "fsdp2_sgd_w2",
        [
            "convert",
            "--to",
            "zero2",
            "--world-size",
            "2",
            "--ds-config",
            "deepspeed_optimizers/z2_sgd_fp32_w2/ds_config.json",
        ],
    ),
    ("fsdp2_w3.consolidate_bf16_shards", "fsdp2_w3", ["consolidate", "--dtype", "bf16", "--max-shard-size", "400B"]),
    ("dcp_zstd_w2.consolidate", "dcp_zstd_w2", ["consolidate"]),
    ("dcp_rank_local_w2.consolidate", "dcp_rank_local_w2", ["consolidate"]),
    # FSDP1 sharded state dict
    ("fsdp1_sharded_w2.reshard1", "fsdp1_sharded_w2", ["reshard", "--to", "1"]),
    (
        "fsdp1_sharded_w2.to_zero2",
        "fsdp1_sharded_w2",
        ["convert", "--to", "zero2", "--world-size", "2", "--ds-config", "deepspeed/z2_fp32_w2/ds_config.json"],
    ),
    # torch.save files
    ("plain_state_dict.consolidate", "plain_state_dict.pt", ["consolidate"]),
    ("plain_state_dict.to_one_safetensors", "plain_state_dict.pt", ["convert", "--to", "safetensors"]),
    ("fsdp1_full_state_dict.to_dcp", "fsdp1_full_state_dict.pt", ["convert", "--to", "dcp", "--world-size", "2"]),
    # DeepSpeed ZeRO 1/2/3
    ("z1_fp16_w2.reshard3", "deepspeed/z1_fp16_w2", ["reshard", "--to", "3"]),
    ("z1_bf16_w2.to_fsdp2", "deepspeed/z1_bf16_w2", ["convert", "--to", "fsdp2", "--world-size", "3"]),
    ("z2_bf16_w2.consolidate", "deepspeed/z2_bf16_w2", ["consolidate", "--include-optimizer"]),
    ("z2_fp32_w2.to_zero3", "deepspeed/z2_fp32_w2", ["convert", "--to", "zero3"]),
    ("z3_bf16_w4.reshard2", "deepspeed/z3_bf16_w4", ["reshard", "--to", "2"]),
    ("z3_bf16_w2.to_torch", "deepspeed/z3_bf16_w2", ["convert", "--to", "torch"]),
    # DeepSpeed with other optimizers
    ("z1_adagrad_fp32_w2.to_dcp", "deepspeed_optimizers/z1_adagrad_fp32_w2", ["convert", "--to", "dcp"]),
    ("z2_sgd_fp32_w2.reshard3", "deepspeed_optimizers/z2_sgd_fp32_w2", ["reshard", "--to", "3"]),
    ("z3_rmsprop_bf16_w2.to_zero1", "deepspeed_optimizers/z3_rmsprop_bf16_w2", ["convert", "--to", "zero1"]),
    ("z3_torchadamw_fp32_w2.to_hf", "deepspeed_optimizers/z3_torchadamw_fp32_w2", ["convert", "--to", "hf"]),
    # FSDP runs of the convert fixtures (accelerate, FSDP2 trained beside DeepSpeed)
    (
        "accelerate_fsdp1_w2.to_zero2",
        "convert/accelerate_fsdp1_w2",
        ["convert", "--to", "zero2", "--world-size", "3", "--ds-config", "deepspeed/z2_fp32_w2/ds_config.json"],
    ),
    ("fsdp2ds_w3.reshard2", "convert/fsdp2ds_w3", ["reshard", "--to", "2"]),
    # Trainer folders
    ("trainer_accel_fsdp2.to_safetensors", "trainer/accel_fsdp2/checkpoint-2", ["convert", "--to", "safetensors"]),
    ("trainer_fsdp2.consolidate", "trainer/fsdp2", ["consolidate"]),
    ("trainer_fsdp1.to_dcp", "trainer/fsdp1", ["convert", "--to", "dcp"]),
    ("trainer_ds_z2.reshard3", "trainer/ds_z2", ["reshard", "--to", "3"]),
    ("trainer_ds_z3.to_torch", "trainer/ds_z3", ["convert", "--to", "torch"]),
    ("trainer_ddp.consolidate", "trainer/ddp", ["consolidate"]),
    # Lightning
    ("lightning_single.consolidate", "lightning/single_w1.ckpt", ["consolidate"]),
    (
        "lightning_groups.to_dcp",
        "lightning/groups_w1.ckpt",
        ["convert", "--to", "dcp", "--world-size", "2", "--model-only"],
    ),
    ("lightning_fsdp.reshard3", "lightning/fsdp_sharded_w2", ["reshard", "--to", "3"]),
    ("lightning_ds_z2.to_torch", "lightning/deepspeed_z2_w2", ["convert", "--to", "torch"]),
    # DeepSpeed model parallelism: each family resharded along each dimension that can change,
    # consolidated, and its index pinned by an `inspect --json` digest
    ("ds_tp.mpu_z2_fp32.reshard_tp1", "ds_tp/mpu_z2_fp32", ["reshard", "--to", "tp=1,dp=2"]),
    ("ds_tp.mpu_z1_bf16.reshard_dp1", "ds_tp/mpu_z1_bf16", ["reshard", "--to", "tp=2,dp=1"]),
    ("ds_tp.mpu_z3_fp32.consolidate", "ds_tp/mpu_z3_fp32", ["consolidate", "--include-optimizer"]),
    ("ds_tp.autotp_z2_fp32.reshard_tp1_dp3", "ds_tp/autotp_z2_fp32", ["reshard", "--to", "tp=1,dp=3"]),
    ("ds_tp.autotp_z3_bf16.to_torch", "ds_tp/autotp_z3_bf16", ["convert", "--to", "torch"]),
    ("ds_tp.mpu_z2_fp32.inspect", "ds_tp/mpu_z2_fp32", ["inspect"]),
    ("ds_pp.pp2_dp2_z1_fp32.reshard_pp3", "ds_pp/pp2_dp2_z1_fp32", ["reshard", "--to", "pp=3,dp=1"]),
    ("ds_pp.tiedhead.reshard_pp1_dp2", "ds_pp/pp2_dp1_z1_fp32_tiedhead", ["reshard", "--to", "pp=1,dp=2"]),
    ("ds_pp.pp2_dp2_z1_bf16.consolidate", "ds_pp/pp2_dp2_z1_bf16", ["consolidate"]),
    ("ds_pp.pp2_dp2_z1_fp32.inspect", "ds_pp/pp2_dp2_z1_fp32", ["inspect"]),
    (
        "ds_3d.bf16.reshard_tp1_dp2",
        "ds_3d/pp2_tp2_dp1_z1_bf16",
        ["reshard", "--to", "tp=1,pp=2,dp=2", "--partition-method", "uniform"],
    ),
    (
        "ds_3d.dp2.reshard_pp1",
        "ds_3d/pp2_tp2_dp2_z1_fp32",
        ["reshard", "--to", "tp=2,pp=1,dp=2", "--partition-method", "uniform"],
    ),
    ("ds_3d.fp32.consolidate", "ds_3d/pp2_tp2_dp1_z1_fp32", ["consolidate"]),
    ("ds_3d.dp2.inspect", "ds_3d/pp2_tp2_dp2_z1_fp32", ["inspect"]),
    ("ds_moe.z2_w4.reshard_ep2_dp4", "ds_moe/moe_z2_fp32_w4_k1", ["reshard", "--to", "ep=2,dp=4"]),
    ("ds_moe.z1_bf16_w4.reshard_ep1_dp3", "ds_moe/moe_z1_bf16_w4_k2", ["reshard", "--to", "ep=1,dp=3"]),
    ("ds_moe.moe2.consolidate", "ds_moe/moe2_z2_fp32_w2_k1", ["consolidate", "--include-optimizer"]),
    ("ds_moe.z1_bf16_w4.inspect", "ds_moe/moe_z1_bf16_w4_k2", ["inspect"]),
    ("ds_moe_tp.z2.reshard_tp1", "ds_moe_tp/moetp_z2_fp32_tp2_ep2_w4", ["reshard", "--to", "tp=1,ep=2,dp=2"]),
    (
        "ds_moe_tp.noexptp.reshard_ep4",
        "ds_moe_tp/moetp_noexptp_z2_fp32_tp2_ep2_w4",
        ["reshard", "--to", "tp=2,ep=4,dp=2"],
    ),
    ("ds_moe_tp.z1_bf16.consolidate", "ds_moe_tp/moetp_z1_bf16_tp2_ep2_w4", ["consolidate"]),
    ("ds_moe_tp.z2.inspect", "ds_moe_tp/moetp_z2_fp32_tp2_ep2_w4", ["inspect"]),
    ("ds_pp_moe.reshard_pp1", "ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4", ["reshard", "--to", "pp=1,ep=2,dp=2"]),
    ("ds_pp_moe.moe4.reshard_ep4", "ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4_moe4", ["reshard", "--to", "pp=2,ep=4,dp=4"]),
    ("ds_pp_moe.consolidate", "ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4", ["consolidate"]),
    ("ds_pp_moe.inspect", "ds_pp_moe/ppmoe_z1_fp32_pp2_ep2_w4", ["inspect"]),
    # tp added with --tp-rules to DeepSpeed checkpoints saved without it (grow_tp.py)
    (
        "ds_grow_tp.moe.reshard_tp2",
        "ds_grow_tp/moe/moetp_z2_fp32_tp1_ep2_w2",
        ["reshard", "--to", "tp=2,ep=2,dp=2", "--tp-rules", "docs/tp_rules.grow.json"],
    ),
    (
        "ds_grow_tp.pp.reshard_tp2",
        "ds_grow_tp/pp/pp2_tp1_dp2_z1_fp32",
        ["reshard", "--to", "tp=2,pp=2,dp=1", "--tp-rules", "docs/tp_rules.grow.json", "--partition-method", "uniform"],
    ),
    ("z2_bf16_w2.to_ds_universal", "deepspeed/z2_bf16_w2", ["convert", "--to", "ds-universal"]),
    ("z3_fp32_w2.to_ds_universal", "deepspeed/z3_fp32_w2", ["convert", "--to", "ds-universal"]),
    ("ds_universal.z2_bf16_w2.to_torch", "ds_universal/z2_bf16_w2", ["convert", "--to", "torch"]),
    ("ds_universal.z3_fp32_w2.inspect", "ds_universal/z3_fp32_w2", ["inspect"]),
]


def _args(case_args: list[str]) -> list[str]:
    """Resolve fixture-relative --ds-config and repository-relative --tp-rules paths so the command
    works from any directory."""
    out = list(case_args)
    for i, a in enumerate(out):
        if i and out[i - 1] == "--ds-config":
            out[i] = str(DATA / a)
        elif i and out[i - 1] == "--tp-rules":
            out[i] = str(ROOT / a)
    return out


def digest_tree(out: Path) -> dict[str, str]:
    """SHA-256 of every file under `out` (or of `out` itself), keyed by its path relative to `out`."""
    files = [out] if out.is_file() else sorted(p for p in out.rglob("*") if p.is_file())
    result: dict[str, str] = {}
    for p in files:
        rel = p.name if p == out else p.relative_to(out).as_posix()
        if p.name in SKIP_NAMES:
            continue
        result[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return result


def _inspect_digest(result) -> dict[str, str]:
    """The SHA-256 of `inspect --json`'s document with its `root` (the fixture's absolute path) blanked,
    so the index a reader builds is pinned wherever the checkout lies."""
    if result.exit_code != 0:
        return {"error": f"exit {result.exit_code}: {result.output.strip()[-300:]}"}
    doc = json.loads(result.output)
    doc["root"] = "SRC"
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return {"inspect.json": hashlib.sha256(text.encode()).hexdigest()}


def run_case(case_id: str, src: str, args: list[str], work: Path) -> dict[str, str]:
    """Run one command in-process; its output digests, or an 'error' entry with the exit and text."""
    from click.testing import CliRunner

    from cli.main import cli

    command, rest = args[0], _args(args[1:])
    if command == "inspect":
        return _inspect_digest(CliRunner().invoke(cli, ["inspect", "--json", str(DATA / src), *rest]))
    suffix = (
        ".pt"
        if command == "convert" and rest[:2] == ["--to", "torch"]
        else ".safetensors"
        if case_id.endswith("to_one_safetensors")
        else ""
    )
    out = work / f"{case_id}{suffix}"
    result = CliRunner().invoke(cli, ["-q", command, str(DATA / src), str(out), *rest])
    if result.exit_code != 0:
        return {"error": f"exit {result.exit_code}: {result.output.strip()[-300:]}"}
    return digest_tree(out)


def compute_all(skip: set[str] | frozenset[str] = frozenset()) -> dict[str, dict[str, str]]:
    """Digests of every case not in `skip`, run in a fresh temporary folder."""
    with tempfile.TemporaryDirectory(prefix="ckptkit-pin-") as tmp:
        return {cid: run_case(cid, src, args, Path(tmp)) for cid, src, args in CASES if cid not in skip}


def main() -> int:
    digests = compute_all()
    failed = {k: v["error"] for k, v in digests.items() if "error" in v}
    if failed:
        for k, v in failed.items():
            print(f"{k}: {v}", file=sys.stderr)
        return 1
    DIGESTS.parent.mkdir(parents=True, exist_ok=True)
    DIGESTS.write_text(json.dumps({"cases": digests}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DIGESTS.relative_to(ROOT)}: {len(digests)} cases, {sum(len(v) for v in digests.values())} files")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
