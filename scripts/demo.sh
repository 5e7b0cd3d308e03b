#!/usr/bin/env bash
# The demo command from the README: set up the environment, then run `ckptkit demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
exec "$VENV/bin/ckptkit" demo "$@"
