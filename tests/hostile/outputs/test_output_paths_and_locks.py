"""An output never touches its source; --overwrite is atomic and leaves nothing; locks cannot race.

Through the CLI (tests/helpers/hostile.py: exit 2, one sentence naming the paths, source byte-identical,
nothing left in OUT's parent) for consolidate, reshard and convert: OUT that is SRC, inside SRC,
contains SRC or is a file of SRC, directly or through symlinks, hard links and bind mounts, with and
without --overwrite; odd things at OUT and at the lock path. In one process: the lock protocol
under threads and processes racing for one stale lock, and sweeps that never remove a live run's
temporary folder.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from ckptkit import knobs
from ckptkit.errors import OutputError
from ckptkit.storage import lock_owner, locks, swap
from ckptkit.storage.locks import lock_is_stale, remove_stale_lock
from ckptkit.storage.output import open_output
from ckptkit.storage.overlap import relation
from ckptkit.storage.rename_output import recover
from helpers.hostile import Scene, check_refused, listing, rss_bound, run_ckptkit, snapshot

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fixtures" / "data"
COMMANDS = {"consolidate": [], "reshard": ["--to", "3"], "convert": ["--to", "torch"]}
FILE_COMMANDS = ["consolidate", "convert"]  # reshard refuses a torch.save file before any output


@pytest.fixture()
def src(tmp_path) -> Path:
    path = tmp_path / "work" / "src"
    shutil.copytree(DATA / "fsdp2_w2", path)
    return path


@pytest.fixture()
def pt(tmp_path) -> Path:
    path = tmp_path / "work" / "model.pt"
    path.parent.mkdir(parents=True)
    shutil.copyfile(DATA / "plain_state_dict.pt", path)
    return path


def _run(cmd: str, source: Path, out: Path, *extra: str):
    return run_ckptkit(cmd, str(source), str(out), *COMMANDS[cmd], *extra)


def _limit() -> int:
    return rss_bound(knobs.MEMORY_BUDGET, 0, with_torch=True)


def _refused_overlap(cmd: str, source: Path, out: Path, overwrite: bool, watch: Path | None = None) -> None:
    """The overlap refusal: one sentence naming OUT and SRC, nothing changed or left anywhere."""
    scene = Scene(source, out=watch or out)
    res = _run(cmd, source, out, *(["--overwrite"] if overwrite else []))
    check_refused(res, str(source), os.path.abspath(out), scene=scene, rss_limit=_limit())
    assert "source" in res.stderr
    assert not [n for n in os.listdir(source.parent) if "ckptkit" in n], os.listdir(source.parent)


# ---- OUT overlapping SRC, every command, with and without --overwrite --------------------------


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "plain"])
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_out_is_the_source(src, cmd, overwrite):
    _refused_overlap(cmd, src, src, overwrite)


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "plain"])
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_out_contains_the_source(src, cmd, overwrite):
    _refused_overlap(cmd, src, src.parent, overwrite)


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "plain"])
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_out_is_a_file_inside_the_source(src, cmd, overwrite):
    _refused_overlap(cmd, src, src / "__0_0.distcp", overwrite)


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_a_new_out_inside_the_source_is_refused(src, cmd):
    _refused_overlap(cmd, src, src / "new_out", overwrite=False)
    assert not (src / "new_out").exists()


def test_out_two_levels_up_and_a_deeper_new_folder(src):
    _refused_overlap("consolidate", src, src.parent.parent, overwrite=True)
    (src / "sub").mkdir()
    _refused_overlap("reshard", src, src / "sub" / "deeper", overwrite=True)


# ---- the same overlaps hidden behind symlinks, hard links and bind mounts ------------------------


def test_out_through_a_symlink_to_the_source(src):
    link = src.parent / "alias"
    os.symlink(src, link)
    _refused_overlap("reshard", src, link, overwrite=True)
    assert os.readlink(link) == str(src)


def test_out_under_a_symlinked_folder_that_is_the_source(src):
    link = src.parent / "alias"
    os.symlink(src, link)
    _refused_overlap("convert", src, link / "new_out", overwrite=False, watch=src / "new_out")


def test_out_a_symlink_whose_target_is_inside_the_source(src):
    for target in (src / "__1_0.distcp", src / "not_there_yet"):
        link = src.parent / "to_inside"
        os.symlink(target, link)
        _refused_overlap("consolidate", src, link, overwrite=True)
        os.unlink(link)


def test_out_a_hard_link_to_a_file_of_the_source(src):
    hard = src.parent / "hard.distcp"
    os.link(src / "__0_0.distcp", hard)
    for cmd in COMMANDS:
        _refused_overlap(cmd, src, hard, overwrite=True)
    assert os.stat(hard).st_ino == os.stat(src / "__0_0.distcp").st_ino


def test_source_given_through_a_symlink_and_out_the_real_folder(src):
    link = src.parent / "alias"
    os.symlink(src, link)
    _refused_overlap("consolidate", link, src, overwrite=True, watch=src)


@pytest.fixture()
def bind_of(tmp_path):
    """Bind-mount a folder elsewhere (root only; skipped, saying why, where mounting is not allowed)."""
    made = []

    def bind(folder: Path) -> Path:
        where = tmp_path / f"bind{len(made)}"
        where.mkdir()
        proc = subprocess.run(["mount", "--bind", str(folder), str(where)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot bind-mount ({proc.stderr.strip() or 'mount failed'}; needs root)")
        made.append(where)
        return where

    yield bind
    for where in reversed(made):
        subprocess.run(["umount", str(where)], capture_output=True)


def test_out_a_bind_mount_of_the_source_or_of_its_parent(src, bind_of):
    same = bind_of(src)
    assert os.path.realpath(same) != os.path.realpath(src)  # paths alone cannot tell
    _refused_overlap("reshard", src, same, overwrite=True)
    _refused_overlap("consolidate", src, same / "new_out", overwrite=False, watch=src / "new_out")
    parent = bind_of(src.parent)
    _refused_overlap("convert", src, parent, overwrite=True)
    _refused_overlap("convert", src, parent / "src", overwrite=True, watch=src)


# ---- a file source (torch.save) ----------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "plain"])
@pytest.mark.parametrize("cmd", FILE_COMMANDS)
def test_out_is_the_source_file(pt, cmd, overwrite):
    _refused_overlap(cmd, pt, pt, overwrite)


@pytest.mark.parametrize("cmd", FILE_COMMANDS)
def test_out_a_hard_link_or_symlink_to_the_source_file(pt, cmd):
    hard, soft = pt.parent / "hard.pt", pt.parent / "soft.pt"
    os.link(pt, hard)
    os.symlink(pt, soft)
    _refused_overlap(cmd, pt, hard, overwrite=True)
    _refused_overlap(cmd, pt, soft, overwrite=True)


def test_convert_never_overwrites_its_ds_config(src, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}))
    before = cfg.read_bytes()
    scene = Scene(src, out=cfg)
    res = run_ckptkit("convert", str(src), str(cfg), "--to", "zero2", "--ds-config", str(cfg), "--overwrite")
    check_refused(res, str(cfg), scene=scene, rss_limit=_limit())
    assert cfg.read_bytes() == before


# ---- odd things at OUT and at the lock path ----------------------------------------------------


def test_a_dangling_symlink_out(src, tmp_path):
    link = tmp_path / "work" / "OUT"
    os.symlink(tmp_path / "nowhere", link)
    scene = Scene(src, out=link)
    res = _run("consolidate", src, link)
    check_refused(res, str(link), scene=scene, out_may_exist=True)
    assert "exists" in res.stderr and os.path.islink(link)
    res = _run("consolidate", src, link, "--overwrite")
    assert res.code == 0, res.detail()
    assert not os.path.islink(link) and (link / "model.safetensors").is_file()
    assert not (tmp_path / "nowhere").exists()  # replaced the link, never wrote through it
    assert scene.new_in_parent() == set() and scene.source_unchanged()


def test_overwrite_of_a_symlink_to_a_folder_replaces_the_link_not_the_target(src, tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / "work" / "OUT"
    os.symlink(target, link)
    before = snapshot(target)
    scene = Scene(src, out=link)
    res = _run("reshard", src, link, "--overwrite")
    assert res.code == 0, res.detail()
    assert not os.path.islink(link) and (link / ".metadata").is_file()
    assert snapshot(target) == before
    assert scene.new_in_parent() == set() and scene.source_unchanged()


@pytest.mark.parametrize("kind", ["file", "symlink", "empty_file"])
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_overwrite_of_a_file_or_symlink_out_leaves_nothing_behind(src, tmp_path, cmd, kind):
    out = tmp_path / "work" / "OUT"
    other = tmp_path / "other.txt"
    other.write_text("not to be touched")
    if kind == "symlink":
        os.symlink(other, out)
    else:
        out.write_text("" if kind == "empty_file" else "an old file")
    parent_before = listing(out.parent)
    res = _run(cmd, src, out, "--overwrite")
    assert res.code == 0, res.detail()
    assert out.is_dir() and not out.is_symlink()
    assert listing(out.parent) == parent_before  # no OUT.ckptkit-old-*, no temporary, no lock
    assert other.read_text() == "not to be touched"


def test_overwrite_without_an_atomic_exchange_leaves_no_old_copy(tmp_path, monkeypatch):
    """Where renameat2 is missing, the old OUT goes aside under a swept name and is removed."""
    monkeypatch.setattr(swap, "exchange", lambda a, b: False)
    for old in ("file", "folder", "symlink"):
        out = tmp_path / f"OUT_{old}"
        if old == "file":
            out.write_text("old")
        elif old == "folder":
            out.mkdir()
            (out / "ro").mkdir()
            (out / "ro" / "x").write_text("old")
            os.chmod(out / "ro", 0o500)
        else:
            os.symlink(tmp_path, out)
        with open_output(str(out), overwrite=True) as target:
            target.write_bytes("new", b"new")
        assert (out / "new").read_bytes() == b"new" and not out.is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["OUT_file", "OUT_folder", "OUT_symlink"]


def test_a_run_killed_between_the_two_renames_is_put_right(src, tmp_path):
    """A kill after `OUT -> .OUT.ckptkit-old-TOKEN` and before the new folder's rename: the next
    run puts the old OUT back (so a run without --overwrite refuses, and the data is not lost)
    and removes the dead run's temporary folder and pending lock."""
    work = tmp_path / "work"
    dead = uuid.uuid4().hex[:16]
    old = work / f".OUT.ckptkit-old-{dead}"
    old.mkdir()
    (old / "model.safetensors").write_text("the previous output")
    (work / f".OUT.ckptkit-tmp-{dead}").mkdir()
    (work / f".OUT.ckptkit-lock-{dead}").write_text("half")
    (work / ".OUT.ckptkit-lock").write_bytes(_dead_lock(dead))
    res = _run("consolidate", src, work / "OUT")
    assert res.code == 2 and "already exists" in res.stderr, res.detail()
    assert (work / "OUT" / "model.safetensors").read_text() == "the previous output"
    assert sorted(os.listdir(work)) == ["OUT", "src"]
    res = _run("consolidate", src, work / "OUT", "--overwrite")
    assert res.code == 0, res.detail()
    assert sorted(os.listdir(work)) == ["OUT", "src"]


@pytest.mark.parametrize("kind", ["folder", "symlink", "fifo", "dangling"])
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_something_else_at_the_lock_path(src, tmp_path, cmd, kind):
    out = tmp_path / "work" / "OUT"
    lock = out.parent / ".OUT.ckptkit-lock"
    if kind == "folder":
        lock.mkdir()
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        os.symlink(tmp_path / ("nowhere" if kind == "dangling" else "elsewhere"), lock)
        (tmp_path / "elsewhere").write_text(str(os.getpid()))
    scene = Scene(src, out=out)
    res = _run(cmd, src, out, "--overwrite")
    check_refused(res, str(lock), scene=scene, rss_limit=_limit())
    assert os.path.lexists(lock) and "remove it" in res.stderr


def test_out_whose_parent_is_a_file(src, tmp_path):
    afile = tmp_path / "work" / "afile"
    afile.write_text("x")
    for cmd in COMMANDS:
        scene = Scene(src, out=afile)
        res = _run(cmd, src, afile / "OUT", "--overwrite")
        check_refused(res, str(afile), scene=scene, rss_limit=_limit())
        assert afile.read_text() == "x"


@pytest.fixture()
def read_only_folder(tmp_path):
    where = tmp_path / "ro"
    where.mkdir()
    if os.geteuid() != 0:
        os.chmod(where, 0o555)
        yield where
        os.chmod(where, 0o755)
        return
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(where)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs ({proc.stderr.strip() or 'mount failed'})")
    yield where
    subprocess.run(["umount", str(where)], capture_output=True)


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_out_in_a_read_only_folder(src, read_only_folder, cmd):
    out = read_only_folder / "OUT"
    scene = Scene(src, out=out)
    res = _run(cmd, src, out)
    check_refused(res, str(read_only_folder), scene=scene, rss_limit=_limit())
    assert "cannot write" in res.stderr


@pytest.mark.parametrize(
    "name",
    [".OUT.ckptkit-tmp-0123456789abcdef", ".OUT.ckptkit-old-0123456789abcdef", "OUT.ckptkit-old-deadbeef"],
    ids=["tmp", "old", "legacy-old"],
)
def test_a_source_named_like_a_leftover_is_never_swept(tmp_path, name):
    """Reading from what looks like a dead run's temporary or aside copy: the sweep keeps it."""
    work = tmp_path / "work"
    source = work / name
    shutil.copytree(DATA / "fsdp2_w2", source)
    (work / ".OUT.ckptkit-lock").write_bytes(_dead_lock())
    scene = Scene(source)
    res = _run("reshard", source, work / "OUT", "--overwrite")
    assert res.code == 0, res.detail()
    assert scene.source_unchanged() and sorted(os.listdir(work)) == sorted(["OUT", name])


# ---- locks: what counts as stale -----------------------------------------------------------------


def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1  # no process can have it


def _lock_doc(pid: int, token: str = "", host: str | None = None, **extra) -> bytes:
    owner = lock_owner.Owner.me(token or uuid.uuid4().hex[:16])
    doc = json.loads(owner.encode())
    doc.update(pid=pid, host=host or socket.gethostname(), **extra)
    return (json.dumps(doc) + "\n").encode()


def _dead_lock(token: str = "") -> bytes:
    return _lock_doc(_dead_pid(), token, start=None)


def test_what_counts_as_stale(tmp_path):
    lock = tmp_path / ".OUT.ckptkit-lock"
    me = _lock_doc(os.getpid())
    cases = {
        b"": False,  # created, pid not yet written
        b"   \n": False,
        b"\x00\xff garbage": False,
        b'{"pid": 1}': False,  # not ours
        b"x" * 5000: False,
        str(_dead_pid()).encode(): True,  # an older ckptkit's bare pid, process gone
        str(os.getpid()).encode(): False,
        me: False,
        _dead_lock(): True,
        _lock_doc(_dead_pid(), host="another-host"): False,  # never judged from here
        _lock_doc(_dead_pid(), host="evil\nerror: forged"): False,  # not a host name ckptkit writes
        _lock_doc(os.getpid(), start=1): True,  # the pid was reused by a later process
        _lock_doc(os.getpid(), boot="another-boot"): True,  # this machine rebooted since
        _lock_doc(os.getpid(), pidns="pid:[1]"): False,  # another container: not ours to judge
    }
    for data, stale in cases.items():
        lock.write_bytes(data)
        assert lock_is_stale(str(lock)) is stale, data[:80]
        assert remove_stale_lock(str(lock)) is stale, data[:80]
        assert lock.exists() is not stale
    lock.unlink()
    lock.mkdir()
    assert lock_is_stale(str(lock)) is False and remove_stale_lock(str(lock)) is False


@pytest.mark.parametrize(
    "data,words",
    [
        (b"", ["empty", "remove it"]),
        (b"\x00garbage", ["cannot be judged", "remove it"]),
        (None, ["another-host", "another machine", "remove"]),
        (b"forged", ["cannot be judged", "remove it"]),
    ],
    ids=["empty", "garbled", "other-host", "line-break-in-host"],
)
def test_a_lock_that_cannot_be_judged_is_refused_and_kept(src, tmp_path, data, words):
    out = tmp_path / "work" / "OUT"
    lock = out.parent / ".OUT.ckptkit-lock"
    data = _lock_doc(_dead_pid(), host="another-host") if data is None else data
    data = _lock_doc(_dead_pid(), host="evil\nerror: forged") if data == b"forged" else data
    lock.write_bytes(data)
    scene = Scene(src, out=out)
    res = _run("consolidate", src, out, "--overwrite")
    check_refused(res, str(lock), *words, scene=scene, rss_limit=_limit())
    assert lock.read_bytes() == data


def test_a_dead_runs_lock_and_temporary_are_taken_over(src, tmp_path):
    work = tmp_path / "work"
    dead = uuid.uuid4().hex[:16]
    (work / ".OUT.ckptkit-lock").write_bytes(_dead_lock(dead))
    (work / f".OUT.ckptkit-tmp-{dead}").mkdir()
    (work / ".OUT.ckptkit-tmp-deadbeef").mkdir()  # an older ckptkit's temporary
    res = _run("reshard", src, work / "OUT")
    assert res.code == 0, res.detail()
    assert sorted(os.listdir(work)) == ["OUT", "src"]


# ---- locks: races ------------------------------------------------------------------------------


def _race(lock: str, racers: int) -> list[str]:
    """`racers` threads take the lock at once; each returns 'won' or the refusal."""
    barrier = threading.Barrier(racers)
    results: list[str] = [""] * racers

    def one(i: int) -> None:
        barrier.wait()
        try:
            locks.acquire(lock, uuid.uuid4().hex[:16], "OUT")
            results[i] = "won"
        except OutputError as exc:
            results[i] = str(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_racers_for_one_stale_lock_exactly_one_wins(tmp_path):
    lock = str(tmp_path / ".OUT.ckptkit-lock")
    for _ in range(50):
        with open(lock, "wb") as f:
            f.write(_dead_lock())
        results = _race(lock, 4)
        assert results.count("won") == 1, results
        assert all("another ckptkit run is writing this output" in r for r in results if r != "won"), results
        owner = lock_owner.parse_owner(Path(lock).read_bytes())
        assert owner.pid == os.getpid()
        assert os.listdir(tmp_path) == [".OUT.ckptkit-lock"]  # no pending file left
        os.unlink(lock)


def test_racers_for_a_free_lock_exactly_one_wins(tmp_path):
    lock = str(tmp_path / ".OUT.ckptkit-lock")
    for _ in range(50):
        results = _race(lock, 4)
        assert results.count("won") == 1, results
        assert os.listdir(tmp_path) == [".OUT.ckptkit-lock"]
        os.unlink(lock)


def _take(lock: str, start, done, results) -> None:
    start.wait()
    try:
        locks.acquire(lock, uuid.uuid4().hex[:16], "OUT")
        results.put("won")
    except OutputError:
        results.put("refused")
    done.wait(30)  # the winner stays alive until every racer has tried (a dead winner's lock is stale)
    results.close()
    results.join_thread()
    os._exit(0)  # keep the lock file as it is: the test judges by the results


def test_processes_racing_for_one_stale_lock(tmp_path):
    ctx = multiprocessing.get_context("fork")
    lock = str(tmp_path / ".OUT.ckptkit-lock")
    for _ in range(10):
        Path(lock).write_bytes(_dead_lock())
        start, done, results = ctx.Event(), ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=_take, args=(lock, start, done, results)) for _ in range(3)]
        for p in procs:
            p.start()
        start.set()
        for p in procs:
            p.join(30)
        outcomes = sorted(results.get(timeout=10) for _ in procs)
        assert outcomes == ["refused", "refused", "won"], outcomes
        os.unlink(lock)


def test_a_sweep_racing_a_takeover_never_removes_the_winners_lock(tmp_path):
    """The Checkpointer's sweep (remove_stale_lock) against runs taking the same stale lock over:
    whoever got it keeps it."""
    lock = str(tmp_path / ".OUT.ckptkit-lock")
    for _ in range(50):
        Path(lock).write_bytes(_dead_lock())
        barrier = threading.Barrier(3)
        won: list[locks.HeldLock] = []

        def run() -> None:
            barrier.wait()
            try:
                won.append(locks.acquire(lock, uuid.uuid4().hex[:16], "OUT"))
            except OutputError:
                pass

        def sweep() -> None:
            barrier.wait()
            remove_stale_lock(lock)

        threads = [threading.Thread(target=f) for f in (run, run, sweep)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1  # the sweep may remove the stale lock, never the winner's
        assert lock_owner.parse_owner(Path(lock).read_bytes()).token == won[0].token
        won[0].release()
        assert os.listdir(tmp_path) == []


def test_a_live_runs_temporary_is_never_swept(src, tmp_path):
    """While one run writes OUT, another run (CLI, --overwrite), a recover() sweep and the
    Checkpointer's stale-lock removal all leave its lock and temporary folder alone."""
    work = tmp_path / "work"
    out = work / "OUT"
    with open_output(str(out), overwrite=True) as live:
        live.write_bytes("marker", b"live")
        res = _run("consolidate", src, out, "--overwrite")
        check_refused(res, ".OUT.ckptkit-lock", "another ckptkit run is writing this output")
        assert recover(str(out)) is False
        assert remove_stale_lock(str(work / ".OUT.ckptkit-lock")) is False
        assert (Path(live.tmp) / "marker").read_bytes() == b"live"
    assert (out / "marker").read_bytes() == b"live"
    assert sorted(os.listdir(work)) == ["OUT", "src"]


def test_entering_the_same_out_at_once_one_wins_and_keeps_its_temporary(tmp_path):
    """Runs racing into one OUT over a dead run's leftovers: one enters, the rest refuse, and the
    winner's temporary folder survives every sweep."""
    out = tmp_path / "OUT"
    for _ in range(20):
        dead = uuid.uuid4().hex[:16]
        (tmp_path / ".OUT.ckptkit-lock").write_bytes(_dead_lock(dead))
        (tmp_path / f".OUT.ckptkit-tmp-{dead}").mkdir()
        barrier = threading.Barrier(3)
        entered: list = []
        refused: list[str] = []

        def run() -> None:
            target = open_output(str(out), overwrite=True)
            barrier.wait()
            try:
                target.__enter__()
                entered.append(target)
            except OutputError as exc:
                refused.append(str(exc))

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(entered) == 1 and len(refused) == 2, refused
        winner = entered[0]
        assert os.path.isdir(winner.tmp)
        winner.write_bytes("x", b"1")
        winner.__exit__(None, None, None)
        assert sorted(os.listdir(tmp_path)) == ["OUT"]


# ---- remote outputs ----------------------------------------------------------------------------


def test_remote_out_overlapping_a_remote_source_is_refused_before_anything_is_removed():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/trust-bucket/src/.metadata", b"m")
    before = sorted(fs.find("/trust-bucket"))
    for out, words in [
        ("memory://trust-bucket/src", "is the source"),
        ("memory://trust-bucket", "contains"),
        ("memory://trust-bucket/src/x", "is inside"),
    ]:
        with pytest.raises(OutputError, match=words):
            with open_output(out, overwrite=True, sources=("memory://trust-bucket/src",)):
                pass
        assert sorted(fs.find("/trust-bucket")) == before
    assert relation("memory://trust-bucket/src", "memory://trust-bucket/src2") is None
    assert relation("/local/src", "memory://local/src") is None
    fs.rm("/trust-bucket", recursive=True)


def test_an_out_that_appears_during_a_plain_run_is_not_replaced(tmp_path):
    """Without --overwrite, something created at OUT while the run wrote is never replaced."""
    out = tmp_path / "OUT"
    with pytest.raises(OutputError, match="already exists"):
        with open_output(str(out)) as target:
            target.write_bytes("new", b"new")
            out.mkdir()
            (out / "theirs").write_text("theirs")
    assert os.listdir(out) == ["theirs"]
    assert sorted(os.listdir(tmp_path)) == ["OUT"]


@pytest.mark.slow
def test_a_distributed_run_refuses_the_overlap_once_and_writes_nothing(src):
    """--nproc 2 (torchrun): rank 0's check stops every rank; one sentence, nothing written."""
    scene = Scene(src, out=src / "inside")
    res = run_ckptkit("reshard", str(src), str(src / "inside"), "--to", "3", "--nproc", "2", timeout=180)
    check_refused(res, str(src), str(src / "inside"), scene=scene)
