#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment with the project's dependencies
# (requirements.txt) and megatron_ep installed in editable mode, its CUDA extension compiled in
# place when nvcc and a CUDA build of torch are present. Sourced by run_demo.sh and test.sh.
#   MEP_VENV=path   where the environment lives (default: .venv in the repository)
#   MEP_SKIP_CUDA=1 skip the extension build
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MEP_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
"$VENV/bin/python" -m pip install -q -r "$ROOT/requirements.txt"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
# the package itself (a .pth to the source tree), then the extension in place
MEP_SKIP_CUDA=1 "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
if [ "${MEP_SKIP_CUDA:-0}" != "1" ]; then
  (cd "$ROOT" && MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VENV/bin/python" setup.py -q build_ext --inplace)
fi
export PATH="$VENV/bin:$PATH"
