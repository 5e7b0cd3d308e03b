"""Hostile Megatron-Core folders: a save plan in `.metadata` that names a foreign callable, a
`common.pt` whose args are no Namespace but code, a `latest_checkpointed_iteration.txt` that names
no iteration: each refused in one sentence, nothing run, nothing written, the source untouched."""

from __future__ import annotations

import pickle
import shutil
import zipfile
from pathlib import Path

from ckptkit.repickle import dumps
from ckptkit.safeload import restricted_loads
from ckptkit.safeload.inert import inert_class
from conftest import DATA
from helpers.hostile import Scene, check_refused, run_ckptkit

SRC = DATA / "mcore" / "tp2_swiglu_gqa"
ITER = "iter_0000002"


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "save"
    shutil.copytree(SRC, root)
    return root


def test_a_save_plan_naming_a_foreign_callable_is_refused(tmp_path):
    root = _copy(tmp_path)
    meta = root / ITER / ".metadata"
    md = restricted_loads(meta.read_bytes(), "x")
    md.all_local_plans[0].items[0].__dict__["type"] = inert_class("posix.system")("touch pwned")
    meta.write_bytes(dumps(md, protocol=2))
    out = tmp_path / "out"
    scene = Scene(root, out)
    run = run_ckptkit("consolidate", root, out)
    check_refused(run, ".metadata", "posix.system", scene=scene)
    assert not (tmp_path / "pwned").exists() and not out.exists()


class _Evil:
    def __reduce__(self):
        return (eval, ("__import__('os').system('touch pwned')",))


def test_common_args_that_are_code_are_refused(tmp_path):
    root = _copy(tmp_path)
    common = root / ITER / "common.pt"
    with zipfile.ZipFile(common) as z:
        members = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in members if n.endswith("/data.pkl"))
    members[pkl] = pickle.dumps({"args": _Evil(), "iteration": 2}, protocol=2)
    with zipfile.ZipFile(common, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    scene = Scene(root)
    run = run_ckptkit("inspect", root)
    check_refused(run, "common.pt", ".eval'", scene=scene)
    assert not (tmp_path / "pwned").exists()


def test_a_latest_file_naming_no_iteration_is_refused(tmp_path):
    root = _copy(tmp_path)
    (root / "latest_checkpointed_iteration.txt").write_text("../../etc")
    scene = Scene(root)
    run = run_ckptkit("inspect", root)
    check_refused(run, "latest_checkpointed_iteration.txt", scene=scene)


def test_a_latest_file_naming_a_missing_iteration_is_refused(tmp_path):
    root = _copy(tmp_path)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    scene = Scene(root)
    run = run_ckptkit("inspect", root)
    check_refused(run, "iter_0000007", ITER, scene=scene)
