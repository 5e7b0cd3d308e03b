#!/usr/bin/env bash
# Create (or reuse) a virtual environment with ckptkit, its pinned dev dependencies and deepspeed
# (fixture generation and the real-engine tests; reading checkpoints never needs it).
# VENV selects the folder (default .venv). torch is pinned by constraints.txt to the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c constraints.txt -e '.[dev,deepspeed]'
# DeepSpeed builds its two CPU ops (fused Adam, shared-memory comm) on first use: a few minutes on
# 2 cores, for every new environment. Build them here, once, so that no test waits on the build
# inside its own timeout.
DS_ACCELERATOR=cpu "$VENV/bin/python" -c "
from deepspeed.accelerator import get_accelerator
for name in ('FusedAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(name).load(verbose=False)
"
