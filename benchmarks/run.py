"""The benchmark entry point: real checkpoints of chosen sizes, ckptkit against the tools a user
would otherwise use, in one run, with a growth table and a process-count curve.

    python benchmarks/run.py [--sizes 100M,400M] [--repeat 3] [--nproc 1,2] [--work /tmp/ckptkit-bench-all] [--keep]
                            [--in-job-mb 1200] [--zero3-params 20000]
                            [--tensors 10000,30000,100000]

For each size (100M params ~ 1.2 GB, 400M ~ 4.6 GB of fp32 masters + Adam moments):
  1. writes a ZeRO-3 bf16 checkpoint with DeepSpeed (2 CPU ranks) and an FSDP2 DCP checkpoint with
     AdamW (torchrun, 2 ranks), unless the work folder already holds them (--keep keeps them);
  2. with the page cache dropped before every run (root), measures wall time and peak RSS, median
     of --repeat runs:
       ZeRO-3: ckptkit consolidate  vs  zero_to_fp32.py --safe_serialization
               ckptkit reshard 2->3  vs  cp -r (and cp -r && sync: the same durability)
               ckptkit convert zero3 -> dcp  vs  cp -r
       DCP:    ckptkit consolidate  vs  torch's loader (_load_state_dict_from_keys) + safetensors.save_file
               ckptkit reshard 2->3  vs  cp -r
       both:   the disk's floor for the same bytes: reading every file (cat) and writing as many
               bytes with fsync (dd conv=fsync), and both at once (cat & dd: a disk that shares its
               time between reads and writes cannot beat it); reshard is stated against
               max(read, write+fsync) and against the two at once
     and checks that the consolidated outputs agree bit for bit with the peers';
  3. at the largest size, the same reshard and convert with --nproc P for each P of --nproc;
  4. in-job saves and loads (bench_in_job.py, torchrun on 2 gloo ranks, FSDP2 + AdamW with
     --in-job-mb MB of state; 0 skips it): a training step with an async save in it (the
     stall: save returns + optimizer.step's wait for the copy; durable), and restore, against
     dcp.async_save and dcp.load + set_state_dict;
  5. the cost per parameter (bench_zero3_many.py): a ZeRO-3 bf16 checkpoint of --zero3-params small
     parameters (0 skips it): inspect vs zero_to_fp32's parsing, consolidate (and with
     --include-optimizer) vs zero_to_fp32.py, reshard --to 3, weights checked bit for bit;
  6. the cost per tensor (bench_many_tensors.py): a dcp.save checkpoint of N small tensors for each N
     of --tensors (empty skips it): inspect vs read_metadata, consolidate vs dcp_to_torch_save,
     reshard --to 2, consolidated outputs checked bit for bit.
Prints the tables (Markdown) and the ratios the goals are stated in, and writes them as JSON to
<work>/results.json. docs/performance.md keeps the latest output with the machine and the date.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_dcp  # noqa: E402
import bench_in_job  # noqa: E402
import bench_many_tensors  # noqa: E402
import bench_zero3  # noqa: E402
import bench_zero3_many  # noqa: E402
from _measure import drop_caches, du, machine_line, median_of, print_table, run_python, run_shell  # noqa: E402


def _generate(kind: str, size: str, path: str) -> None:
    layers, width = (bench_zero3 if kind == "zero3" else bench_dcp).SIZES[size]
    marker = os.path.join(path, "latest" if kind == "zero3" else ".metadata")
    if os.path.exists(marker):
        return
    shutil.rmtree(path, ignore_errors=True)
    print(f"writing a real {kind} checkpoint ({size} params, 2 ranks) into {path} ...", flush=True)
    script = os.path.join(os.path.dirname(path), f"writer_{kind}.py")
    open(script, "w").write(bench_zero3.WRITER if kind == "zero3" else bench_dcp.WRITER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
                    str(layers), str(width), path], check=True, env=env)


def _same_safetensors(a: str, b: str) -> bool:
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


def _ckptkit(*args: str, nproc: int = 1):
    extra = ["--nproc", str(nproc)] if nproc > 1 else []
    return lambda: run_python(["-m", "ckptkit", "--quiet", *args, *extra], {"DS_ACCELERATOR": "cpu"})


def _read_floor(src: str):
    """The disk's read floor for `src`: every file read once, in one process (cold cache)."""
    return run_shell(["sh", "-c", f"find '{src}' -type f -exec cat {{}} + > /dev/null"])


def _write_floor(nbytes: int, out: str):
    """The disk's write floor: as many bytes written and fsynced as a reshard writes, in 4 MiB blocks."""
    os.makedirs(out, exist_ok=True)
    blocks = max(1, -(-nbytes // (4 << 20)))
    return run_shell(["dd", "if=/dev/zero", f"of={os.path.join(out, 'floor')}", "bs=4M", f"count={blocks}",
                      "conv=fsync", "status=none"])


def _together_floor(src: str, nbytes: int, out: str):
    """Both floors at once: every source file read while as many bytes are written and fsynced.
    A reshard reads and writes the same bytes; on a disk that shares its time between reads and
    writes (rather than overlapping them) this, not the larger floor alone, is what any copy costs."""
    os.makedirs(out, exist_ok=True)
    blocks = max(1, -(-nbytes // (4 << 20)))
    return run_shell(["sh", "-c", f"find '{src}' -type f -exec cat {{}} + > /dev/null & "
                      f"dd if=/dev/zero of='{os.path.join(out, 'floor')}' bs=4M count={blocks} conv=fsync "
                      f"status=none; wait"])


def measure_size(size: str, work: str, repeat: int) -> dict:
    base = os.path.join(work, size)
    os.makedirs(base, exist_ok=True)
    z3, dcp = os.path.join(base, "zero3_w2"), os.path.join(base, "dcp_w2")
    _generate("zero3", size, z3)
    _generate("dcp", size, dcp)
    out = os.path.join(base, "out")

    def fresh():
        shutil.rmtree(out, ignore_errors=True)

    def run(label: str, tool: str, fn) -> tuple:
        wall, rss = median_of(repeat, fn, fresh)
        print(f"  {label:<22} {tool:<42} {wall:8.2f} s {rss:8.0f} MB", flush=True)
        return label, tool, wall, rss

    ds_env = {"DS_ACCELERATOR": "cpu"}
    script = os.path.join(base, "torch_path.py")
    open(script, "w").write(bench_dcp.TORCH_PATH)

    def torch_path(target: str) -> tuple:
        os.makedirs(target, exist_ok=True)
        return run_python([script, dcp, os.path.join(target, "model.safetensors")])

    rows = [
        run("zero3 consolidate", "ckptkit", _ckptkit("consolidate", z3, out)),
        run("zero3 consolidate", "zero_to_fp32.py --safe_serialization", lambda: run_python(
            [os.path.join(z3, "zero_to_fp32.py"), z3, out, "--safe_serialization"], ds_env)),
        run("zero3 reshard 2->3", "ckptkit", _ckptkit("reshard", z3, out, "--to", "3")),
        run("zero3 reshard 2->3", "cp -r", lambda: run_shell(["cp", "-r", z3, out])),
        run("zero3 reshard 2->3", "cp -r && sync", lambda: run_shell(["sh", "-c", f"cp -r '{z3}' '{out}' && sync"])),
        run("zero3 -> dcp", "ckptkit convert", _ckptkit("convert", z3, out, "--to", "dcp", "--world-size", "2")),
        run("dcp consolidate", "ckptkit", _ckptkit("consolidate", dcp, out)),
        run("dcp consolidate", "torch loader + safetensors.save_file", lambda: torch_path(out)),
        run("dcp reshard 2->3", "ckptkit", _ckptkit("reshard", dcp, out, "--to", "3")),
        run("dcp reshard 2->3", "cp -r", lambda: run_shell(["cp", "-r", dcp, out])),
        run("zero3 disk floor", "read: cat every file", lambda: _read_floor(z3)),
        run("zero3 disk floor", "write+fsync: dd conv=fsync", lambda: _write_floor(du(z3), out)),
        run("dcp disk floor", "read: cat every file", lambda: _read_floor(dcp)),
        run("dcp disk floor", "write+fsync: dd conv=fsync", lambda: _write_floor(du(dcp), out)),
        run("zero3 disk floor", "read and write+fsync at once: cat & dd", lambda: _together_floor(z3, du(z3), out)),
        run("dcp disk floor", "read and write+fsync at once: cat & dd", lambda: _together_floor(dcp, du(dcp), out)),
    ]
    # outputs agree bit for bit with the peers'
    agree = {}
    for kind, src, peer in (("zero3", z3, "zero_to_fp32"), ("dcp", dcp, "torch")):
        mine, theirs = os.path.join(base, f"agree_{kind}_ck"), os.path.join(base, f"agree_{kind}_peer")
        for p in (mine, theirs):
            shutil.rmtree(p, ignore_errors=True)
        _ckptkit("consolidate", src, mine)()
        if kind == "zero3":
            run_python([os.path.join(z3, "zero_to_fp32.py"), z3, theirs, "--safe_serialization"], ds_env)
        else:
            torch_path(theirs)
        agree[kind] = _same_safetensors(os.path.join(mine, "model.safetensors"), os.path.join(theirs, "model.safetensors"))
        shutil.rmtree(mine)
        shutil.rmtree(theirs)
    fresh()
    sizes = {"zero3_gb": du(z3) / 1e9, "dcp_gb": du(dcp) / 1e9}
    return {"size": size, "gb": sizes, "rows": rows, "agree": agree}


def ratios(result: dict) -> dict:
    r = {(op, tool): (wall, rss) for op, tool, wall, rss in result["rows"]}

    def q(a, b, i):
        return r[a][i] / r[b][i]

    return {
        "zero3 consolidate wall vs zero_to_fp32": q(("zero3 consolidate", "ckptkit"),
                                                   ("zero3 consolidate", "zero_to_fp32.py --safe_serialization"), 0),
        "zero3 consolidate RSS vs zero_to_fp32": q(("zero3 consolidate", "ckptkit"),
                                                  ("zero3 consolidate", "zero_to_fp32.py --safe_serialization"), 1),
        "zero3 reshard wall vs cp -r": q(("zero3 reshard 2->3", "ckptkit"), ("zero3 reshard 2->3", "cp -r"), 0),
        "zero3 reshard wall vs cp -r && sync": q(("zero3 reshard 2->3", "ckptkit"),
                                                 ("zero3 reshard 2->3", "cp -r && sync"), 0),
        "zero3 -> dcp wall vs cp -r": q(("zero3 -> dcp", "ckptkit convert"), ("zero3 reshard 2->3", "cp -r"), 0),
        "dcp consolidate wall vs torch": q(("dcp consolidate", "ckptkit"),
                                           ("dcp consolidate", "torch loader + safetensors.save_file"), 0),
        "dcp consolidate RSS vs torch": q(("dcp consolidate", "ckptkit"),
                                          ("dcp consolidate", "torch loader + safetensors.save_file"), 1),
        "dcp reshard wall vs cp -r": q(("dcp reshard 2->3", "ckptkit"), ("dcp reshard 2->3", "cp -r"), 0),
        "zero3 reshard wall vs disk floor max(read, write+fsync)": r[("zero3 reshard 2->3", "ckptkit")][0] / max(
            r[("zero3 disk floor", "read: cat every file")][0], r[("zero3 disk floor", "write+fsync: dd conv=fsync")][0]),
        "dcp reshard wall vs disk floor max(read, write+fsync)": r[("dcp reshard 2->3", "ckptkit")][0] / max(
            r[("dcp disk floor", "read: cat every file")][0], r[("dcp disk floor", "write+fsync: dd conv=fsync")][0]),
        "zero3 reshard wall vs disk floor read and write at once": q(
            ("zero3 reshard 2->3", "ckptkit"), ("zero3 disk floor", "read and write+fsync at once: cat & dd"), 0),
        "dcp reshard wall vs disk floor read and write at once": q(
            ("dcp reshard 2->3", "ckptkit"), ("dcp disk floor", "read and write+fsync at once: cat & dd"), 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100M,400M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nproc", default="1,2", help="process counts for the curve at the largest size")
    ap.add_argument("--work", default="/tmp/ckptkit-bench-all")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints for reruns")
    ap.add_argument("--in-job-mb", type=int, default=1200,
                    help="MB of FSDP2 + AdamW state for the in-job case (bench_in_job.py); 0 skips it")
    ap.add_argument("--zero3-params", type=int, default=20000,
                    help="parameters of the many-parameter ZeRO-3 case (bench_zero3_many.py); 0 skips it")
    ap.add_argument("--tensors", default="10000,30000,100000",
                    help="tensor counts of the many-tensor DCP case (bench_many_tensors.py); empty skips it")
    args = ap.parse_args()
    try:
        import huggingface_hub  # noqa: F401  (zero_to_fp32.py needs it)
    except ImportError:
        raise SystemExit("zero_to_fp32.py needs huggingface_hub: pip install huggingface_hub")
    cold = drop_caches()
    results = []
    for size in args.sizes.split(","):
        print(f"== {size}", flush=True)
        results.append(measure_size(size, args.work, args.repeat))
    largest = results[-1]["size"]
    curve = []
    base = os.path.join(args.work, largest)
    for p in [int(x) for x in args.nproc.split(",")]:
        out = os.path.join(base, "out")
        for label, fn in (("zero3 reshard 2->3", _ckptkit("reshard", os.path.join(base, "zero3_w2"), out, "--to", "3",
                                                          nproc=p)),
                          ("zero3 -> dcp", _ckptkit("convert", os.path.join(base, "zero3_w2"), out, "--to", "dcp",
                                                    nproc=p))):
            wall, rss = median_of(args.repeat, fn, lambda: shutil.rmtree(out, ignore_errors=True))
            rss = rss if p == 1 else float("nan")  # with --nproc the wrapper measures only the launcher
            curve.append((label, p, wall, rss))
            print(f"  {label:<22} --nproc {p}: {wall:.2f} s", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    in_job = None
    if args.in_job_mb > 0:
        print(f"== in-job saves and loads ({args.in_job_mb} MB of state)", flush=True)
        in_job = bench_in_job.measure(args.in_job_mb, args.repeat, os.path.join(args.work, "in_job"))
    many = None
    if args.zero3_params > 0:
        print(f"== ZeRO-3 of {args.zero3_params} small parameters", flush=True)
        many = bench_zero3_many.measure(args.zero3_params, os.path.join(args.work, "zero3_many"), args.repeat)
    per_tensor = []
    for n in [int(x) for x in args.tensors.split(",") if x]:
        print(f"== DCP of {n} small tensors", flush=True)
        per_tensor.append(bench_many_tensors.measure(n, os.path.join(args.work, "many_tensors"), args.repeat))

    print(f"\n{machine_line()}; cold cache: {'yes' if cold else 'no (not root)'}; median of {args.repeat}")
    for res in results:
        print(f"\n### {res['size']} params: ZeRO-3 bf16 {res['gb']['zero3_gb']:.2f} GB, "
              f"FSDP2 DCP {res['gb']['dcp_gb']:.2f} GB (2 ranks, AdamW)\n")
        print_table(res["rows"])
        print()
        for name, value in ratios(res).items():
            print(f"- {name}: {value:.2f}x")
        print(f"- outputs agree bit for bit with the peers': {res['agree']}")
    if len(results) > 1:
        first, last = results[0], results[-1]
        print(f"\n### Growth {first['size']} -> {last['size']}\n")
        print("| operation | wall growth | peak RSS growth |\n|---|---:|---:|")
        for a, b in zip(first["rows"], last["rows"]):
            if a[1].startswith("ckptkit"):
                print(f"| {a[0]} | {b[2] / a[2]:.2f}x | {100 * (b[3] / a[3] - 1):+.0f}% |")
    print(f"\n### Processes ({largest})\n")
    print("| operation | --nproc | wall (s) | peak RSS (MB, one process) |\n|---|---:|---:|---:|")
    for label, p, wall, rss in curve:
        print(f"| {label} | {p} | {wall:.2f} | {'-' if rss != rss else f'{rss:.0f}'} |")
    if in_job is not None:
        bench_in_job.print_result(in_job)
    if many is not None:
        bench_zero3_many.print_result(many)
    if per_tensor:
        print("\n### DCP of many small tensors\n")
        print_table([row for r in per_tensor for row in r["rows"]])
        print()
        bench_many_tensors.per_tensor_table(per_tensor)
        print(f"\n- consolidated outputs equal torch's: {[r['agree'] for r in per_tensor]}")
    with open(os.path.join(args.work, "results.json"), "w") as f:
        json.dump({"machine": machine_line(), "cold": cold, "results": results,
                   "ratios": {r["size"]: ratios(r) for r in results}, "nproc": curve, "in_job": in_job,
                   "zero3_many": many, "many_tensors": per_tensor}, f, indent=1)
    if not all(all(r["agree"].values()) for r in results):
        raise SystemExit("outputs differ from the peers'")
    if in_job is not None and not all(in_job["equal"].values()):
        raise SystemExit("an in-job restore or load differs from the saved state")
    if many is not None and not many["agree"]:
        raise SystemExit("the many-parameter ZeRO-3 consolidation differs from zero_to_fp32's")
    if not all(r["agree"] for r in per_tensor):
        raise SystemExit("a many-tensor consolidation differs from torch's")
    if not args.keep:
        for res in results:
            shutil.rmtree(os.path.join(args.work, res["size"]), ignore_errors=True)
        shutil.rmtree(os.path.join(args.work, "zero3_many"), ignore_errors=True)
        shutil.rmtree(os.path.join(args.work, "many_tensors"), ignore_errors=True)


if __name__ == "__main__":
    main()
