"""Benchmark: the cost per parameter, on a real DeepSpeed ZeRO-3 checkpoint of many small parameters.

    python benchmarks/bench_zero3_many.py [--params 20000] [--repeat 3] [--work /tmp/ckptkit-bench-z3many]

A model of N parameters of 64 elements each (an nn.ParameterList of 8x8 matrices: MoE models
have this many, per-expert weights) is trained for one step by DeepSpeed on 2 CPU ranks (gloo),
ZeRO-3, bf16, AdamW, and saved once (cached under --work: 20k parameters are ~20 MB). Then, with
the page cache dropped before every run (root only), it measures wall time and peak RSS, median of
--repeat runs, of:

    ckptkit inspect                           vs  zero_to_fp32's parsing step (parse_model_states +
                                                  parse_optim_states: what it reads before merging;
                                                  DeepSpeed has no listing tool, this is the closest)
    ckptkit consolidate                       vs  zero_to_fp32.py --safe_serialization (the script
                                                  DeepSpeed writes into the checkpoint folder)
    ckptkit consolidate --include-optimizer   (no peer: zero_to_fp32 drops the optimizer state)
    ckptkit reshard --to 3                    (no peer: DeepSpeed has no offline reshard)

and checks that ckptkit's consolidated weights equal zero_to_fp32's bit for bit. The payload is
small, so what is measured is bookkeeping: the index, the read plan and the writers' per-parameter
work. zero_to_fp32.py needs huggingface_hub (its --max_shard_size default imports it).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _measure import drop_caches, du, machine_line, median_of, print_table, run_python  # noqa: E402

SHAPE = (8, 8)  # per parameter

WRITER = r"""
import os, sys, torch, deepspeed
n, rows, cols, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)


class Many(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(rows, cols)) for _ in range(n)])

    def forward(self, x):
        return sum((x @ p).sum() for p in self.experts)


model = Many()
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "train_batch_size": 2 * int(os.environ["WORLD_SIZE"]),
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": False}},
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x = torch.randn(2, rows, dtype=torch.bfloat16)
engine.backward(engine(x).float())
engine.step()
engine.save_checkpoint(out, tag="global_step1")
torch.distributed.barrier()
os._exit(0)
"""

PARSE = r"""
import sys
from deepspeed.utils.zero_to_fp32 import get_model_state_files, get_optim_files, parse_model_states, parse_optim_states
tag = sys.argv[1]
states = parse_model_states(get_model_state_files(tag))
stage, world, groups, _ = parse_optim_states(get_optim_files(tag), tag)
print(stage, world, len(states))
"""


def generate(n: int, path: str) -> None:
    """A real ZeRO-3 checkpoint of `n` parameters at `path`, written once (kept between runs)."""
    if os.path.exists(os.path.join(path, "latest")):
        return
    shutil.rmtree(path, ignore_errors=True)
    print(f"writing a real DeepSpeed ZeRO-3 bf16 checkpoint of {n} parameters (2 ranks) into {path} ...", flush=True)
    script = os.path.join(os.path.dirname(path), "writer_z3many.py")
    open(script, "w").write(WRITER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
                    str(n), str(SHAPE[0]), str(SHAPE[1]), path], check=True, env=env)


def _ckptkit(*args: str):
    return lambda: run_python(["-m", "ckptkit", "--quiet", *args], {"DS_ACCELERATOR": "cpu"})


def _same(ours: str, theirs: str) -> bool:
    import torch
    from safetensors.torch import load_file

    a, b = load_file(ours), load_file(theirs)
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def measure(n: int, work: str, repeat: int) -> dict:
    """The rows for one checkpoint of `n` parameters, and whether the consolidations agree."""
    base = os.path.join(work, str(n))
    os.makedirs(base, exist_ok=True)
    src, out = os.path.join(base, "zero3_w2"), os.path.join(base, "out")
    generate(n, src)
    tag = os.path.join(src, open(os.path.join(src, "latest")).read().strip())
    parse = os.path.join(base, "parse.py")
    open(parse, "w").write(PARSE)
    ds_env = {"DS_ACCELERATOR": "cpu"}

    def fresh() -> None:
        shutil.rmtree(out, ignore_errors=True)

    def run(label: str, tool: str, fn) -> tuple:
        wall, rss = median_of(repeat, fn, fresh)
        print(f"  {label:<32} {tool:<38} {wall:8.2f} s {rss:8.0f} MB", flush=True)
        return label, tool, wall, rss

    zero_to_fp32 = [os.path.join(src, "zero_to_fp32.py"), src, out, "--safe_serialization"]
    rows = [
        run(f"inspect ({n})", "ckptkit", _ckptkit("inspect", src)),
        run(f"inspect ({n})", "zero_to_fp32 parse_*_states", lambda: run_python([parse, tag], ds_env)),
        run(f"consolidate ({n})", "ckptkit", _ckptkit("consolidate", src, out)),
        run(f"consolidate ({n})", "zero_to_fp32.py --safe_serialization", lambda: run_python(zero_to_fp32, ds_env)),
        run(f"consolidate --include-optimizer ({n})", "ckptkit",
            _ckptkit("consolidate", src, out, "--include-optimizer")),
        run(f"reshard --to 3 ({n})", "ckptkit", _ckptkit("reshard", src, out, "--to", "3")),
    ]
    mine, theirs = os.path.join(base, "agree_ck"), os.path.join(base, "agree_ds")
    for p in (mine, theirs):
        shutil.rmtree(p, ignore_errors=True)
    _ckptkit("consolidate", src, mine)()
    run_python([zero_to_fp32[0], src, theirs, "--safe_serialization"], ds_env)
    agree = _same(os.path.join(mine, "model.safetensors"), os.path.join(theirs, "model.safetensors"))
    for p in (mine, theirs):
        shutil.rmtree(p, ignore_errors=True)
    fresh()
    return {"params": n, "mb": du(src) / 1e6, "rows": rows, "agree": agree}


def print_result(res: dict) -> None:
    """The Markdown table of one measure() result, the ratios and microseconds per parameter."""
    print(f"\n### ZeRO-3 bf16, {res['params']} parameters of {SHAPE[0]}x{SHAPE[1]} "
          f"({res['mb']:.0f} MB, 2 ranks, AdamW)\n")
    print_table(res["rows"])
    r = {(op.split(" (")[0], tool): wall for op, tool, wall, _ in res["rows"]}
    rss = {(op.split(" (")[0], tool): m for op, tool, _, m in res["rows"]}
    ins, peer_ins = ("inspect", "ckptkit"), ("inspect", "zero_to_fp32 parse_*_states")
    con, peer_con = ("consolidate", "ckptkit"), ("consolidate", "zero_to_fp32.py --safe_serialization")
    print(f"\n- inspect vs zero_to_fp32's parsing: wall {r[ins] / r[peer_ins]:.2f}x, RSS {rss[ins] / rss[peer_ins]:.2f}x")
    print(f"- consolidate vs zero_to_fp32.py: wall {r[con] / r[peer_con]:.2f}x, RSS {rss[con] / rss[peer_con]:.2f}x")
    print(f"- reshard --to 3 vs zero_to_fp32.py: wall {r[('reshard --to 3', 'ckptkit')] / r[peer_con]:.2f}x")
    print("- us per parameter: " + ", ".join(
        f"{op.split(' (')[0]} ({tool}) {1e6 * wall / res['params']:.0f}" for op, tool, wall, _ in res["rows"]))
    print(f"- consolidated weights equal zero_to_fp32's bit for bit: {res['agree']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3, help="cold runs per command; the median wall is reported")
    ap.add_argument("--work", default="/tmp/ckptkit-bench-z3many")
    args = ap.parse_args()
    try:
        import huggingface_hub  # noqa: F401  (zero_to_fp32.py needs it)
    except ImportError:
        raise SystemExit("zero_to_fp32.py needs huggingface_hub: pip install huggingface_hub")
    cold = drop_caches()
    res = measure(args.params, args.work, args.repeat)
    print(f"\n{machine_line()}; cold cache: {'yes' if cold else 'no (not root)'}; median of {args.repeat}")
    print_result(res)
    if not res["agree"]:
        raise SystemExit("consolidated weights differ from zero_to_fp32's")


if __name__ == "__main__":
    main()
