#!/usr/bin/env bash
# The demo command from the README: set up the environment with what `ckptkit demo` needs (ckptkit
# and its runtime dependencies, no test extras; scripts/setup.sh), then run `ckptkit demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
exec "$VENV/bin/ckptkit" demo "$@"
