#!/usr/bin/env bash
# Create (or reuse) the virtual environment, at one of two levels:
#   bash scripts/setup.sh          ckptkit (editable) with its runtime dependencies only: torch's CPU
#                                  build, safetensors, click, fsspec, tqdm, numpy. All that
#                                  `ckptkit demo` (scripts/demo.sh) needs: about a minute from nothing.
#   bash scripts/setup.sh --test   the same, plus the test extras (dev, deepspeed) on top in the same
#                                  folder, and the build of DeepSpeed's two C++ CPU ops (scripts/test.sh).
# VENV selects the folder (default .venv). Versions are pinned by constraints.txt.
# pip's own output goes to $VENV/setup.log and is shown only if pip fails: a successful setup is
# two lines, not pages of resolver and build messages.
# A second run with nothing changed (same pyproject.toml, constraints.txt and this script, for the
# same level or a fuller one) skips pip and returns at once; delete $VENV/.setup-* to force it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
level=runtime
extras=""
case "${1:-}" in
  "") ;;
  --test) level=test; extras="[dev,deepspeed]" ;;
  *) echo "usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
esac

digest=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
stamp_ok() {  # this level (or the test level, which holds the runtime one) was set up from these files
  [ "$(cat "$VENV/.setup-$1" 2>/dev/null)" = "$digest" ]
}
if [ -x "$VENV/bin/python" ] && { stamp_ok "$level" || stamp_ok test; } \
    && "$VENV/bin/python" -c 'import ckptkit_cli' 2>/dev/null; then
  exit 0
fi

started=$SECONDS
if [ "$level" = runtime ]; then
  echo "setting up $VENV: ckptkit and its runtime dependencies (torch's CPU build; about a minute the first time) ..."
else
  echo "setting up $VENV for the tests: ckptkit's test extras and DeepSpeed's CPU ops (a few minutes the first time) ..."
fi
log="$VENV/setup.log"
pip_quiet() {  # pip with its output in the log; the log is printed if it fails
  if ! "$VENV/bin/python" -m pip "$@" >> "$log" 2>&1; then
    cat "$log" >&2
    echo "setup failed: pip $* (the output above is also in $log)" >&2
    exit 1
  fi
}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
: > "$log"
rm -f "$VENV/.setup-runtime" "$VENV/.setup-test"
# --no-compile: pip would byte-compile every module it installs, one at a time (torch's and sympy's
# thousands: most of a first setup's time); what is used is compiled below instead
pip_quiet install --no-compile -c constraints.txt --upgrade pip -e ".$extras"
if [ "$level" = runtime ]; then
  # compile what `ckptkit demo` imports, once (python does it on first import, but not where
  # PYTHONDONTWRITEBYTECODE is set, and then each of the demo's processes would compile torch again)
  env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c "
import torch.distributed.checkpoint, torch.distributed.fsdp, torch.multiprocessing, torch.optim, torch._dynamo
import safetensors.torch, fsspec, ckptkit_cli.main" >> "$log" 2>&1 || { cat "$log" >&2; echo "setup failed: importing torch (see $log)" >&2; exit 1; }
else
  # the suite starts hundreds of python processes: compile everything installed, on every core
  "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    >> "$log" 2>&1 || true  # a few packages ship files that are not meant to compile (pip ignores them too)
  # DeepSpeed builds its two CPU ops (fused Adam, shared-memory comm) on first use: a few minutes on
  # 2 cores, for every new environment. Build them here, once, so that no test waits on the build
  # inside its own timeout.
  DS_ACCELERATOR=cpu "$VENV/bin/python" -c "
from deepspeed.accelerator import get_accelerator
for name in ('FusedAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(name).load(verbose=False)
" >> "$log" 2>&1 || { cat "$log" >&2; echo "setup failed: building DeepSpeed's CPU ops (see $log)" >&2; exit 1; }
  echo "$digest" > "$VENV/.setup-test"
fi
echo "$digest" > "$VENV/.setup-runtime"
echo "$VENV is ready ($((SECONDS - started)) s)"
