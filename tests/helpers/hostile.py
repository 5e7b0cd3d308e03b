"""The harness every hostile-input and misuse test runs ckptkit through.

One call runs `python -m ckptkit ARGS` in a fresh interpreter, under an address-space limit and a
wall-clock timeout, and measures the child's peak RSS (wait4). `check_refused` then asserts the whole
trust contract of docs/reliability.md at once:

- the exit status (2 for bad input, 130 for Ctrl-C) and one `error: ` sentence naming the file;
- no traceback, no "internal error";
- peak RSS <= max(memory budget, 2 x the hostile file's size) + 100 MB above what the interpreter
  itself needs for that command (torch's import when the command imports torch);
- finished within the timeout;
- every file of the source byte-identical afterwards (content, links, modes);
- nothing new left in OUT's parent.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import tempfile
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20
ADDRESS_LIMIT = 8 << 30  # hard stop for a runaway child: the machine has 24 GiB and 2 cores
DEFAULT_TIMEOUT = 60.0
SLACK = 100 * MB


@dataclass
class Run:
    args: tuple[str, ...]
    code: int
    stdout: str
    stderr: str
    peak_rss: int  # bytes
    seconds: float
    timed_out: bool = False

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def detail(self) -> str:
        return (
            f"ckptkit {' '.join(self.args)}\nexit {self.code}, {self.seconds:.1f} s, peak RSS "
            f"{self.peak_rss / MB:.0f} MB\n--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n"
            f"{self.stderr[-3000:]}"
        )


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("CKPTKIT_FOLLOW_LINKS", None)
    return env


LAUNCHER = Path(__file__).resolve().parent / "_measured.py"


def run_python(
    code: list[str], timeout: float = DEFAULT_TIMEOUT, cwd: str | None = None, interrupt_after: float | None = None
) -> Run:
    """Run `python CODE...` limited and measured; `interrupt_after` sends SIGINT to the
    command after that many seconds.

    The command runs under tests/helpers/_measured.py, which reports its exit status and its own peak RSS."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report")
        proc = subprocess.Popen(
            [sys.executable, str(LAUNCHER), report, str(ADDRESS_LIMIT), sys.executable, *code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=_env(),
            cwd=cwd,
            start_new_session=True,
        )
        chunks: dict[str, bytes] = {}

        def drain(name: str, stream) -> None:
            chunks[name] = stream.read()

        readers = [
            threading.Thread(target=drain, args=(n, s), daemon=True)
            for n, s in (("out", proc.stdout), ("err", proc.stderr))
        ]
        for r in readers:
            r.start()
        timed_out, interrupted = False, False
        while proc.poll() is None:
            elapsed = time.monotonic() - start
            if interrupt_after is not None and not interrupted and elapsed >= interrupt_after:
                os.kill(proc.pid, signal.SIGINT)  # the launcher passes it on
                interrupted = True
            if elapsed > timeout and not timed_out:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.01)
        for r in readers:
            r.join()
        code_, peak = proc.returncode, 0
        if os.path.exists(report):
            status, peak_text = open(report).read().split()
            code_, peak = os.waitstatus_to_exitcode(int(status)), int(peak_text)
    seconds = time.monotonic() - start
    return Run(
        tuple(code),
        code_,
        chunks.get("out", b"").decode(errors="replace"),
        chunks.get("err", b"").decode(errors="replace"),
        peak,
        seconds,
        timed_out,
    )


def run_ckptkit(
    *args: str, timeout: float = DEFAULT_TIMEOUT, cwd: str | None = None, interrupt_after: float | None = None
) -> Run:
    run = run_python(
        ["-m", "ckptkit", *[str(a) for a in args]], timeout=timeout, cwd=cwd, interrupt_after=interrupt_after
    )
    run.args = tuple(str(a) for a in args)
    return run


@lru_cache(maxsize=None)
def baseline_rss(with_torch: bool) -> int:
    """Peak RSS of an interpreter that imported ckptkit's CLI (and torch, when asked)."""
    code = "import ckptkit_cli.main, numpy" + (", torch" if with_torch else "")
    return run_python(["-c", code]).peak_rss


def rss_bound(budget: int, hostile_file_size: int, with_torch: bool = True) -> int:
    """The promise: max(budget, 2 x the file's size) + 100 MB over the interpreter's own needs."""
    return baseline_rss(with_torch) + max(budget, 2 * hostile_file_size) + SLACK


# ---- what must not change ----------------------------------------------------------------------


def snapshot(path: Path) -> dict[str, tuple]:
    """Every entry under `path` (not following links): kind, mode, content digest or link target."""
    path = Path(path)
    entries: dict[str, tuple] = {}

    def one(p: Path, rel: str) -> None:
        st = os.lstat(p)
        if os.path.islink(p):
            entries[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            entries[rel] = ("dir", st.st_mode)
            for child in sorted(os.listdir(p)):
                one(p / child, f"{rel}/{child}" if rel else child)
        elif p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            entries[rel] = ("file", st.st_mode, st.st_size, h.hexdigest())
        else:
            entries[rel] = ("other", st.st_mode)

    if os.path.lexists(path):
        one(path, "")
    return entries


def listing(folder: Path) -> set[str]:
    folder = Path(folder)
    return set(os.listdir(folder)) if folder.is_dir() else set()


@dataclass
class Scene:
    """A source (and optionally an output) watched across one run."""

    source: Path
    out: Path | None = None
    before: dict = field(default_factory=dict)
    parent_before: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.before = snapshot(self.source)
        if self.out is not None:
            self.parent_before = listing(self.out.parent)

    def source_unchanged(self) -> bool:
        return snapshot(self.source) == self.before

    def new_in_parent(self) -> set[str]:
        if self.out is None:
            return set()
        return listing(self.out.parent) - self.parent_before


def check_refused(
    run: Run,
    *names: str,
    scene: Scene | None = None,
    code: int = 2,
    rss_limit: int | None = None,
    out_may_exist: bool = False,
) -> None:
    """The whole contract for input ckptkit must refuse."""
    detail = run.detail()
    assert not run.timed_out, f"did not finish within the timeout\n{detail}"
    assert run.code == code, detail
    assert "Traceback" not in run.output, detail
    assert "internal error" not in run.output, detail
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one error sentence\n{detail}"
    elif code == 130:
        assert lines and "interrupted" in lines[-1], detail
    for name in names:
        assert name in run.stderr, f"message does not name {name!r}\n{detail}"
    if rss_limit is not None:
        assert run.peak_rss <= rss_limit, (
            f"peak RSS {run.peak_rss / MB:.0f} MB over the bound {rss_limit / MB:.0f} MB\n{detail}"
        )
    if scene is not None:
        assert scene.source_unchanged(), f"the source changed\n{detail}"
        if scene.out is not None:
            new = scene.new_in_parent()
            if out_may_exist:
                new.discard(scene.out.name)
            assert not new, f"left in OUT's parent: {sorted(new)}\n{detail}"
