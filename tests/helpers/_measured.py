"""Run one command and write its exit status and its own peak RSS to a report file.

tests/helpers/hostile.py starts this small launcher, which forks the real command. Linux carries a
process's peak RSS across exec from the memory it was forked with, so a command forked straight
from a large pytest process would report pytest's pages as its own; forked from this launcher it
reports only its own (plus the launcher's few MB). A SIGINT sent to the launcher is passed on to
the command alone, and the launcher applies the address-space limit.

usage: python _measured.py REPORT ADDRESS_LIMIT COMMAND...
"""

import os
import resource
import signal
import sys

report, limit, command = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
signal.signal(signal.SIGINT, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        os.execv(command[0], command)
    finally:
        os._exit(127)


def _pass_on(signum, frame) -> None:
    """A SIGINT sent to the launcher goes on to the command alone (as to the process a user runs);
    wait4 is resumed after the handler (PEP 475). One that lands just after wait4 reaped the
    command has no one to reach: the command's own exit status stands."""
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        pass


signal.signal(signal.SIGINT, _pass_on)
_, status, usage = os.wait4(pid, 0)
with open(report, "w") as f:
    f.write(f"{status} {usage.ru_maxrss * 1024}\n")
