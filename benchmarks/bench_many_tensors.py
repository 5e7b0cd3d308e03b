"""Benchmark: the cost per tensor, on a genuine DCP checkpoint of many small tensors.

    python benchmarks/bench_many_tensors.py [--tensors 10000,100000] [--repeat 3] [--work /tmp/ckptkit-bench-many]
                                            [--peer-limit 100000]

A checkpoint of N tensors of 32 fp32 elements each (128 bytes: MoE models have this many tensors,
per-expert weights and their optimizer state) is written once by torch's own `dcp.save` (one
process), then, with the page cache dropped before every run (root only), it measures wall time
and peak RSS, median of --repeat runs, of:

    ckptkit inspect          vs  FileSystemReader(path).read_metadata()
    ckptkit consolidate      vs  torch's format_utils.dcp_to_torch_save
    ckptkit reshard --to 2   (no peer: torch has no offline reshard)

and checks that the consolidated safetensors equal torch's consolidation bit for bit. The
payload is tiny, so what is measured is bookkeeping: detection, the index, the read plan and the
writers' per-tensor work.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _measure import drop_caches, machine_line, median_of, print_table, run_python  # noqa: E402

ELEMENTS = 32  # per tensor

WRITER = r"""
import sys, torch, torch.distributed.checkpoint as dcp
n, elements, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(0)
state = {f"model.layers.{i // 64}.experts.{i % 64}.w": torch.randn(elements, generator=g) for i in range(n)}
dcp.save(state, checkpoint_id=out, no_dist=True)
"""

READ_METADATA = r"""
import sys
from torch.distributed.checkpoint import FileSystemReader
meta = FileSystemReader(sys.argv[1]).read_metadata()
print(len(meta.state_dict_metadata))
"""

DCP_TO_TORCH = r"""
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""


def _generate(n: int, path: str) -> None:
    if os.path.exists(os.path.join(path, ".metadata")):
        return
    shutil.rmtree(path, ignore_errors=True)
    print(f"writing a DCP checkpoint of {n} tensors with dcp.save into {path} ...", flush=True)
    script = os.path.join(os.path.dirname(path), "writer_many.py")
    open(script, "w").write(WRITER)
    run_python([script, str(n), str(ELEMENTS), path])


def _script(base: str, name: str, text: str) -> str:
    path = os.path.join(base, name)
    open(path, "w").write(text)
    return path


def _ckptkit(*args: str):
    return lambda: run_python(["-m", "ckptkit", "--quiet", *args])


def _same(ours: str, torch_file: str) -> bool:
    import torch
    from safetensors.torch import load_file

    mine = load_file(ours)
    theirs = torch.load(torch_file, weights_only=True)
    return set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def measure(n: int, work: str, repeat: int, peers: bool = True) -> dict:
    """The rows for one checkpoint size, and whether the consolidations agree. Without `peers`
    (a size past --peer-limit), only ckptkit's commands and read_metadata run, once each:
    torch's dcp_to_torch_save of 1M tensors takes many minutes, and the curve is ckptkit's."""
    base = os.path.join(work, str(n))
    os.makedirs(base, exist_ok=True)
    src, out = os.path.join(base, "dcp"), os.path.join(base, "out")
    _generate(n, src)
    read_meta = _script(base, "read_metadata.py", READ_METADATA)
    to_torch = _script(base, "dcp_to_torch.py", DCP_TO_TORCH)

    def fresh() -> None:
        shutil.rmtree(out, ignore_errors=True)
        if os.path.exists(out + ".pt"):
            os.remove(out + ".pt")

    def run(label: str, tool: str, fn) -> tuple:
        wall, rss = median_of(repeat, fn, fresh)
        print(f"  {label:<22} {tool:<34} {wall:8.2f} s {rss:8.0f} MB", flush=True)
        return label, tool, wall, rss

    if not peers:
        repeat = 1
    rows = [
        run(f"inspect ({n})", "ckptkit", _ckptkit("inspect", src)),
        run(f"inspect ({n})", "FileSystemReader.read_metadata", lambda: run_python([read_meta, src])),
        run(f"consolidate ({n})", "ckptkit", _ckptkit("consolidate", src, out)),
        run(f"consolidate ({n})", "format_utils.dcp_to_torch_save", lambda: run_python([to_torch, src, out + ".pt"]))
        if peers else (f"consolidate ({n})", "format_utils.dcp_to_torch_save", None, None),
        run(f"reshard --to 2 ({n})", "ckptkit", _ckptkit("reshard", src, out, "--to", "2")),
    ]
    fresh()
    if not peers:
        return {"tensors": n, "rows": rows, "agree": None}
    _ckptkit("consolidate", src, out)()
    run_python([to_torch, src, out + ".pt"])
    agree = _same(os.path.join(out, "model.safetensors"), out + ".pt")
    fresh()
    return {"tensors": n, "rows": rows, "agree": agree}


def per_tensor_table(results: list[dict]) -> None:
    """Microseconds per tensor of each measured row, to show whether cost grows linearly."""
    print("| operation | tool | " + " | ".join(f"{r['tensors']} tensors (us/tensor)" for r in results) + " |")
    print("|---|---|" + "---:|" * len(results))
    for i, (label, tool, _, _) in enumerate(results[0]["rows"]):
        cells = [f"{1e6 * r['rows'][i][2] / r['tensors']:.0f}" if r['rows'][i][2] is not None else "-"
                 for r in results]
        print(f"| {label.split(' (')[0]} | {tool} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", default="10000,100000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default="/tmp/ckptkit-bench-many")
    ap.add_argument("--peer-limit", type=int, default=100_000,
                    help="past this many tensors: no dcp_to_torch_save and one run of each command")
    args = ap.parse_args()
    cold = drop_caches()
    results = [measure(int(n), args.work, args.repeat, int(n) <= args.peer_limit) for n in args.tensors.split(",")]
    print(f"\n{machine_line()}; cold cache: {'yes' if cold else 'no (not root)'}; median of {args.repeat}\n")
    print_table([row for r in results for row in r["rows"] if row[2] is not None])
    print()
    per_tensor_table(results)
    print(f"\n- consolidated outputs equal torch's: {[r['agree'] for r in results]}")
    if not all(r["agree"] for r in results if r["agree"] is not None):
        raise SystemExit("outputs differ from torch's")


if __name__ == "__main__":
    main()
