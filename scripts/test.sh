#!/usr/bin/env bash
# The test command from the README: set up the environment, then run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slow"`).
# PYTEST_WORKERS=auto (or a number) runs the suite a test file per worker (pytest-xdist, at most 4):
# a file's module fixtures (a DeepSpeed job, the docs' examples) then run once, and
# tests/conftest.py sends the files with multi-process tests out first. It halves the suite's time
# on 2 cores, but one of three such runs lost a rank of a 3-process trainer job to SIGABRT
# ("terminate called without an active exception") while another job ran beside it; until that is
# understood the default is one process (PYTEST_WORKERS=0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
# byte-compile the checkout once: with PYTHONDONTWRITEBYTECODE set (as some sandboxes do), each of the
# suite's hundreds of `python -m ckptkit` and training subprocesses would otherwise compile the same
# sources again (~0.3 s each)
"$VENV/bin/python" -m compileall -q ckptkit cli tests > /dev/null
"$VENV/bin/python" -m compileall -q -l fixtures > /dev/null  # its own scripts, not the checkpoints' copies of zero_to_fp32.py
exec "$VENV/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-0}" --maxprocesses 4 --dist loadfile "$@"
