#!/usr/bin/env bash
# The test command from the README: set up the environment (what the demo needs, plus the test extras
# and DeepSpeed's CPU ops on top, in the same folder; scripts/setup.sh --test), then run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slow"`).
# The suite runs a test file per worker (pytest-xdist, one per core, at most 4): a file's module
# fixtures (a DeepSpeed job, the docs' examples) then run once, and tests/conftest.py sends the
# files with multi-process tests out first (--no-loadscope-reorder: pytest-xdist 3.6+ otherwise
# reorders the files by their number of tests, which sent the few-test DeepSpeed and torchrun files
# out last); on 2 cores it takes about half the time of one process.
# PYTEST_WORKERS=0 runs everything in one process (PYTEST_WORKERS=N: N workers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
VENV="${VENV:-.venv}"
# byte-compile the checkout once: with PYTHONDONTWRITEBYTECODE set (as some sandboxes do), each of the
# suite's hundreds of `python -m ckptkit` and training subprocesses would otherwise compile the same
# sources again (~0.3 s each)
"$VENV/bin/python" -m compileall -q ckptkit cli tests > /dev/null
"$VENV/bin/python" -m compileall -q -l fixtures > /dev/null  # its own scripts, not the checkpoints' copies of zero_to_fp32.py
exec "$VENV/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-auto}" --maxprocesses 4 --dist loadfile --no-loadscope-reorder "$@"
