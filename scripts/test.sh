#!/usr/bin/env bash
# The test command from the README: set up the environment, then run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slow"`).
# The suite runs on every core (pytest-xdist, at most 4 workers; PYTEST_WORKERS=0 runs it in one
# process), a test file per worker: a file's module fixtures (a DeepSpeed job, the docs' examples)
# then run once. tests/conftest.py sends the files with multi-process tests out first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
exec "$VENV/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-auto}" --maxprocesses 4 --dist loadfile "$@"
