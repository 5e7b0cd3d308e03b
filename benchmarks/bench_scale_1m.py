"""Benchmark: a million tensors, ckptkit against torch, each pair in the same run.

    python benchmarks/bench_scale_1m.py [--tensors 100000,1000000] [--repeat 5] [--repeat-large 3]
                                        [--large-from 1000000] [--ops inspect,consolidate,reshard,index,safetensors]
                                        [--cache ~/.cache/ckptkit-bench/scale]

The checkpoint is a genuine `dcp.save` (one process) of N tensors named `layers.{i//8}.p{i%8}.weight`,
each 4x8 fp32: written once and cached under --cache (not in the repository; making the 1M one takes
about 5 minutes on an idle machine, an hour or more on a loaded one). Each comparison runs ckptkit
and torch's tool alternately in fresh subprocesses, --repeat times (--repeat-large from --large-from
tensors on), and reports the median wall time and CPU time (user + system of the child) with their
spread (min-max) and the median peak RSS (the child's own VmHWM):

    inspect       ckptkit inspect              vs  FileSystemReader(path).read_metadata()
    consolidate   ckptkit consolidate          vs  format_utils.dcp_to_torch_save
    reshard       ckptkit reshard --to 2       vs  format_utils.dcp_to_torch_save (torch has no reshard)
    index         the memory the index holds once read (RSS after reading, less RSS before; bytes/tensor)
    metadata      the `.metadata` alone: ckptkit's data-only unpickling vs read_metadata (--metadata-only
                  DIR: a folder holding only a `.metadata`, for a size whose data files were not written)
    safetensors   ckptkit inspect of a safetensors file of N names (each [4, 8] fp32) vs
                  safetensors' safe_open + a get_slice per name (the header parsed, each shape read)

At 1M tensors ckptkit needs a memory budget past the default 512 MiB (the `.metadata` makes 31.5M
objects): run with CKPTKIT_MEMORY_BUDGET=4G in the environment (torch's tools ignore it).

The page cache is not dropped (not root here): every run reads warm files. The consolidated
output is compared with torch's bit for bit once per size (--check).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _measure import machine_line, run_python  # noqa: E402

WRITER = r"""
import sys, torch, torch.distributed.checkpoint as dcp
n, out = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(0)
state = {f"layers.{i // 8}.p{i % 8}.weight": torch.randn(4, 8, generator=g) for i in range(n)}
dcp.save(state, checkpoint_id=out, no_dist=True)
"""

SAFETENSORS_WRITER = r"""
import sys, numpy as np
from safetensors.numpy import save_file
n, out = int(sys.argv[1]), sys.argv[2]
block = np.arange(32, dtype=np.float32).reshape(4, 8)
save_file({f"layers.{i // 8}.p{i % 8}.weight": block for i in range(n)}, out)
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

# a `.metadata` of n entries as dcp.save describes n 4x8 fp32 tensors in one file, pickled by
# torch's own Metadata classes (the data files not written: for a size dcp.save takes too long for)
METADATA_WRITER = r"""
import pickle, sys, torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo
n, out = int(sys.argv[1]), sys.argv[2]
sd, storage, planner = {}, {}, {}
for i in range(n):
    key = f"layers.{i // 8}.p{i % 8}.weight"
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 8]))
    sd[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 8]), [chunk])
    index = MetadataIndex(fqn=key, offset=torch.Size([0, 0]), index=0)
    storage[index] = _StorageInfo(relative_path="__0_0.distcp", offset=1705 * i, length=1705)
    planner[key] = (key,)
with open(out, "wb") as f:
    pickle.dump(Metadata(state_dict_metadata=sd, planner_data=planner, storage_data=storage), f)
"""

# the `.metadata` alone, through ckptkit's data-only unpickling (the fast road, or the machine)
DECODE_METADATA = r"""
import sys
from ckptkit.safeload import restricted_loads_dcp_metadata
path = sys.argv[1] + "/.metadata"
with open(path, "rb") as f:
    md = restricted_loads_dcp_metadata(f.read(), path)
print(len(md.__dict__["state_dict_metadata"]))
"""

SAFE_OPEN = r"""
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], "np") as f:
    shapes = [f.get_slice(k).get_shape() for k in f.keys()]
print(len(shapes))
"""

# the index's own memory: RSS once the index is read and what reading it made is gone, less RSS
# before (imports done); a forked allocator keeps freed arenas, so this is an upper bound
INDEX_MEMORY = r"""
import gc, sys
import ckptkit.formats.registry as registry
import torch  # (imported by the CLI anyway: its pages are not the index's)

def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]) * 1024

gc.collect()
before = rss()
opened = registry.open_checkpoint(sys.argv[1])
index = opened.index
gc.collect()
try:
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
except OSError:
    pass
after = rss()
print("INDEX_BYTES", after - before, len(index.tensors))
"""


def _cache_default() -> str:
    return os.environ.get("CKPTKIT_BENCH_CACHE", os.path.expanduser("~/.cache/ckptkit-bench/scale"))


def _script(base: str, name: str, text: str) -> str:
    path = os.path.join(base, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def fixture(cache: str, n: int) -> str:
    """The cached dcp.save checkpoint of n tensors, written first where it is missing."""
    path = os.path.join(cache, f"dcp-{n}")
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"writing {n} tensors with dcp.save into {path} (minutes) ...", flush=True)
    run_python([_script(cache, "writer_scale.py", WRITER), str(n), tmp])
    os.rename(tmp, path)
    return path


def safetensors_fixture(cache: str, n: int) -> str:
    path = os.path.join(cache, f"names-{n}.safetensors")
    if not os.path.exists(path):
        print(f"writing a safetensors file of {n} names into {path} ...", flush=True)
        run_python([_script(cache, "writer_safetensors.py", SAFETENSORS_WRITER), str(n), path + ".tmp"])
        os.rename(path + ".tmp", path)
    return path


def _ckptkit(*args: str):
    return lambda: run_python(["-m", "ckptkit", "--quiet", *args])


def _cpu_of_children() -> float:
    got = resource.getrusage(resource.RUSAGE_CHILDREN)
    return got.ru_utime + got.ru_stime


def timed(fn) -> tuple[float, float, float]:
    """(wall s, peak RSS MB, CPU s of the child: user + system) of one run: on a shared machine
    the CPU time says what a command costs, the wall time also what the others took."""
    before = _cpu_of_children()
    wall, rss = fn()
    return wall, rss, _cpu_of_children() - before


class Pair:
    """ckptkit and its peer, run alternately `repeat` times; the medians and spreads."""

    def __init__(self, label: str, ours, theirs, theirs_name: str, clean=None) -> None:
        self.label, self.ours, self.theirs, self.theirs_name, self.clean = label, ours, theirs, theirs_name, clean
        self.runs: dict[str, list[tuple[float, float, float]]] = {"ckptkit": [], theirs_name: []}

    def run(self, repeat: int) -> None:
        for i in range(repeat):
            order = [("ckptkit", self.ours), (self.theirs_name, self.theirs)]
            for name, fn in order if i % 2 == 0 else reversed(order):
                if self.clean is not None:
                    self.clean()
                wall, rss, cpu = timed(fn)
                self.runs[name].append((wall, rss, cpu))
                print(f"  {self.label:<26} {name:<20} {wall:8.2f} s wall {cpu:8.2f} s CPU {rss:8.0f} MB", flush=True)
        if self.clean is not None:
            self.clean()

    def summary(self) -> dict:
        out = {}
        for name, runs in self.runs.items():
            walls, rss, cpus = [w for w, _, _ in runs], [r for _, r, _ in runs], [c for _, _, c in runs]
            out[name] = {
                "walls": walls,
                "cpus": cpus,
                "cpu": statistics.median(cpus),
                "cpu_min": min(cpus),
                "cpu_max": max(cpus),
                "wall": statistics.median(walls),
                "wall_min": min(walls),
                "wall_max": max(walls),
                "rss": statistics.median(rss),
                "rss_max": max(rss),
            }
        ours, theirs = out["ckptkit"], out[self.theirs_name]
        out["ratio_wall"] = ours["wall"] / theirs["wall"]
        out["ratio_cpu"] = ours["cpu"] / theirs["cpu"]
        out["ratio_rss"] = ours["rss"] / theirs["rss"]
        return out


def index_memory(src: str, repeat: int) -> dict:
    """Bytes per tensor the index holds once read (median of `repeat` runs)."""
    import subprocess

    got = []
    for _ in range(repeat):
        proc = subprocess.run([sys.executable, "-c", INDEX_MEMORY, src], capture_output=True, text=True, check=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("INDEX_BYTES")][-1].split()
        got.append(int(line[1]) / int(line[2]))
    return {"bytes_per_tensor": statistics.median(got), "runs": got}


def same_output(src: str, base: str) -> bool:
    """ckptkit's consolidation of `src` equals torch's dcp_to_torch_save bit for bit."""
    import torch
    from safetensors.torch import load_file

    out = os.path.join(base, "check-out")
    shutil.rmtree(out, ignore_errors=True)
    _ckptkit("consolidate", src, out)()
    run_python([_script(base, "dcp_to_torch.py", DCP_TO_TORCH), src, out + ".pt"])
    mine = load_file(os.path.join(out, "model.safetensors"))
    theirs = torch.load(out + ".pt", weights_only=True)
    same = set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    shutil.rmtree(out, ignore_errors=True)
    os.remove(out + ".pt")
    return same


def metadata_only_fixture(cache: str, n: int) -> str:
    """A folder holding only a `.metadata` of n entries (METADATA_WRITER), written where missing."""
    path = os.path.join(cache, f"metadata-only-{n}")
    if not os.path.exists(os.path.join(path, ".metadata")):
        os.makedirs(path, exist_ok=True)
        tmp = os.path.join(path, ".metadata.tmp")
        run_python([_script(cache, "writer_metadata.py", METADATA_WRITER), str(n), tmp])
        os.rename(tmp, os.path.join(path, ".metadata"))
    return path


def metadata_only(src: str, n: int, repeat: int) -> dict:
    """The `.metadata` decode alone, ckptkit against read_metadata, alternately."""
    base = os.path.dirname(src)
    ours, theirs = (
        _script(base, "decode_metadata.py", DECODE_METADATA),
        _script(base, "read_metadata.py", READ_METADATA),
    )
    pair = Pair(
        f"decode .metadata ({n})", lambda: run_python([ours, src]), lambda: run_python([theirs, src]), "read_metadata"
    )
    pair.run(repeat)
    return {"tensors": n, "repeat": repeat, "metadata": pair.summary()}


def measure(n: int, cache: str, ops: list[str], repeat: int, check: bool) -> dict:
    src = fixture(cache, n)
    base = os.path.join(cache, f"work-{n}")
    os.makedirs(base, exist_ok=True)
    out = os.path.join(base, "out")
    read_meta = _script(base, "read_metadata.py", READ_METADATA)
    to_torch = _script(base, "dcp_to_torch.py", DCP_TO_TORCH)

    def clean() -> None:
        shutil.rmtree(out, ignore_errors=True)
        if os.path.exists(out + ".pt"):
            os.remove(out + ".pt")

    torch_consolidate = lambda: run_python([to_torch, src, out + ".pt"])  # noqa: E731
    pairs = {
        "inspect": Pair(
            f"inspect ({n})", _ckptkit("inspect", src), lambda: run_python([read_meta, src]), "read_metadata"
        ),
        "consolidate": Pair(
            f"consolidate ({n})", _ckptkit("consolidate", src, out), torch_consolidate, "dcp_to_torch_save", clean
        ),
        "reshard": Pair(
            f"reshard --to 2 ({n})",
            _ckptkit("reshard", src, out, "--to", "2"),
            torch_consolidate,
            "dcp_to_torch_save",
            clean,
        ),
    }
    result: dict = {"tensors": n, "repeat": repeat}
    for op in ops:
        if op in pairs:
            pairs[op].run(repeat)
            result[op] = pairs[op].summary()
        elif op == "index":
            result["index"] = index_memory(src, min(repeat, 3))
            print(f"  index memory ({n}): {result['index']['bytes_per_tensor']:.0f} B/tensor", flush=True)
        elif op == "metadata":
            result["metadata"] = metadata_only(src, n, repeat)["metadata"]
        elif op == "safetensors":
            path = safetensors_fixture(cache, n)
            peer = _script(base, "safe_open.py", SAFE_OPEN)
            pair = Pair(
                f"inspect safetensors ({n})", _ckptkit("inspect", path), lambda: run_python([peer, path]), "safe_open"
            )
            pair.run(repeat)
            result["safetensors"] = pair.summary()
    if check:
        result["same_as_torch"] = same_output(src, base)
    return result


def report(results: list[dict]) -> None:
    print(
        "\n| tensors | operation | ckptkit wall (s), median [min-max] | ckptkit CPU (s) | peer | peer wall (s) | "
        "peer CPU (s) | wall ratio | CPU ratio | RSS ckptkit / peer (MB) | RSS ratio |"
    )
    print("|---:|---|---|---|---|---|---|---:|---:|---|---:|")
    for r in results:
        for op in ("metadata", "inspect", "consolidate", "reshard", "safetensors"):
            if op not in r:
                continue
            s = r[op]
            peer = next(k for k in s if k not in ("ckptkit", "ratio_wall", "ratio_rss", "ratio_cpu"))
            a, b = s["ckptkit"], s[peer]
            print(
                f"| {r['tensors']} | {op} | {a['wall']:.2f} [{a['wall_min']:.2f}-{a['wall_max']:.2f}] | "
                f"{a['cpu']:.2f} [{a['cpu_min']:.2f}-{a['cpu_max']:.2f}] | {peer} | "
                f"{b['wall']:.2f} [{b['wall_min']:.2f}-{b['wall_max']:.2f}] | "
                f"{b['cpu']:.2f} [{b['cpu_min']:.2f}-{b['cpu_max']:.2f}] | {s['ratio_wall']:.2f}x | "
                f"{s['ratio_cpu']:.2f}x | {a['rss']:.0f} / {b['rss']:.0f} | {s['ratio_rss']:.2f}x |"
            )
    for r in results:
        if "index" in r:
            print(f"- index memory at {r['tensors']} tensors: {r['index']['bytes_per_tensor']:.0f} B/tensor")
        if "same_as_torch" in r:
            print(f"- consolidated output equal to torch's at {r['tensors']} tensors: {r['same_as_torch']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", default="100000,1000000")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--repeat-large", type=int, default=3)
    ap.add_argument("--large-from", type=int, default=1_000_000)
    ap.add_argument("--ops", default="index,inspect,consolidate,reshard,safetensors")
    ap.add_argument("--cache", default=_cache_default())
    ap.add_argument("--check", action="store_true", help="compare consolidate's output with torch's once per size")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--metadata-only",
        help="a folder holding only a .metadata, its decode alone; 'make': one written under --cache "
        "by torch's Metadata classes for the first --tensors count",
    )
    args = ap.parse_args()
    os.makedirs(args.cache, exist_ok=True)
    ops = args.ops.split(",")
    results = []
    if args.metadata_only:
        n = int(args.tensors.split(",")[0])
        if args.metadata_only == "make":
            args.metadata_only = metadata_only_fixture(args.cache, n)
        results.append(metadata_only(args.metadata_only, n, args.repeat_large if n >= args.large_from else args.repeat))
    for n in map(int, args.tensors.split(",")) if not args.metadata_only else ():
        repeat = args.repeat_large if n >= args.large_from else args.repeat
        results.append(measure(n, args.cache, ops, repeat, args.check))
    print(f"\n{machine_line()}; warm page cache; load average {os.getloadavg()[0]:.1f} at the end\n")
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
