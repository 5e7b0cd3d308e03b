"""Who owns an output's lock, and whether that run is provably gone.

A lock names its owner by pid, host name, boot id, pid namespace, the process's start time and
a random token. The owner is DEAD only when all of that says so on this machine: same host, and
either the machine rebooted since or the pid is not running (or is a process started at another
time: the pid was reused). A lock from another host or another pid namespace is ELSEWHERE and
never judged; a lock with only a pid in it (older ckptkit) is judged on this host.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from functools import lru_cache


@lru_cache(maxsize=None)
def _read_small(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(200).strip() or None
    except OSError:
        return None


def _boot_id() -> str | None:
    return _read_small("/proc/sys/kernel/random/boot_id")


@lru_cache(maxsize=None)
def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> tuple[bool, int | None]:
    """(running, start time in clock ticks since boot) from /proc; (True, None) where /proc says
    nothing about it, after asking the kernel with signal 0."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):  # a zombie or a dead task: not running
            return False, None
        return True, int(fields[19])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False, None
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, None
    except PermissionError:
        return True, None
    return True, None


@dataclass(frozen=True)
class Owner:
    """What a lock says about the run that holds it."""

    pid: int
    host: str | None = None  # None: a lock written by an older ckptkit (the pid alone)
    boot: str | None = None
    pidns: str | None = None
    start: int | None = None
    token: str | None = None

    @classmethod
    def me(cls, token: str) -> "Owner":
        pid = os.getpid()
        return cls(pid, socket.gethostname(), _boot_id(), _pid_namespace(), _process_start(pid)[1], token)

    def encode(self) -> bytes:
        return (
            json.dumps(
                {
                    "ckptkit_lock": 1,
                    "pid": self.pid,
                    "host": self.host,
                    "boot": self.boot,
                    "pidns": self.pidns,
                    "start": self.start,
                    "token": self.token,
                }
            )
            + "\n"
        ).encode()

    def describe(self) -> str:
        return f"pid {self.pid}" + (f" on host {self.host}" if self.host else "")


def parse_owner(data: bytes) -> Owner:
    """The owner a lock file names; ValueError saying why when it names none."""
    if not data.strip():
        raise ValueError("it is empty: a run may be creating it")
    try:
        text = data.decode("ascii").strip()
        if text.isdigit() and 0 < int(text) < 1 << 31:  # an older ckptkit wrote the pid alone
            return Owner(int(text))
        doc = json.loads(text)
    except ValueError:  # not ASCII, not JSON
        raise ValueError("it is not a ckptkit lock") from None
    if not isinstance(doc, dict) or doc.get("ckptkit_lock") != 1:
        raise ValueError("it is not a ckptkit lock")
    pid, host = doc.get("pid"), doc.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31 or not _word(host):
        raise ValueError("it names no process")
    start = doc.get("start")
    return Owner(
        pid,
        host,
        _str_or_none(doc.get("boot")),
        _str_or_none(doc.get("pidns")),
        start if isinstance(start, int) and not isinstance(start, bool) else None,
        _str_or_none(doc.get("token")),
    )


def _word(value: object) -> bool:
    """A host name, boot id or token as ckptkit writes them: printable, no spaces, not long (a
    lock is shown in error messages, so it may not carry line breaks or escapes)."""
    return isinstance(value, str) and 0 < len(value) <= 255 and value.isprintable() and " " not in value


def _str_or_none(value: object) -> str | None:
    return value if _word(value) else None


DEAD, ALIVE, ELSEWHERE = "dead", "alive", "elsewhere"


def owner_state(owner: Owner) -> str:
    """DEAD only when the owner provably is: on this host (and boot), in this pid namespace."""
    if owner.host is not None:
        if owner.host != socket.gethostname():
            return ELSEWHERE
        if owner.boot and _boot_id() and owner.boot != _boot_id():
            return DEAD  # this machine rebooted since: nothing of that run survives a reboot
        if owner.pidns and _pid_namespace() and owner.pidns != _pid_namespace():
            return ELSEWHERE  # another container on this machine: its pids are not ours to judge
    running, start = _process_start(owner.pid)
    if not running:
        return DEAD
    if owner.start is not None and start is not None and start != owner.start:
        return DEAD  # the pid now belongs to a process started later
    return ALIVE
