#!/usr/bin/env bash
# The test command from the README: set up the environment, then run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slow"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
exec "$VENV/bin/python" -m pytest -q "$@"
