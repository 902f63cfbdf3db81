#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment with the project's dependencies
# (requirements.txt) and megatron_ep installed in editable mode, its CUDA extension compiled in
# place when nvcc and a CUDA build of torch are present. Sourced by run_demo.sh and test.sh;
# afterwards `source .venv/bin/activate` puts the environment on the PATH of your shell.
# A second run installs and compiles only what changed (requirements.txt, csrc/, setup.py).
#   MEP_VENV=path          where the environment lives (default: .venv in the repository)
#   MEP_CPU_ONLY=1         laptops / CPU machines: skip the extension (its kernels run on Hopper
#                          GPUs only); saves the ~2 min compile and the need for nvcc, not the
#                          download: PyPI's torch for Linux is the CUDA build (~5 GB with its
#                          nvidia-* wheels)
#   MEP_TORCH_INDEX_URL=u  install torch from this index first, e.g. PyTorch's CPU-only wheels
#                          https://download.pytorch.org/whl/cpu (~0.2 GB; untested by us: our
#                          machines cannot reach it)
#   MEP_SKIP_CUDA=1        skip the CUDA extension build (what MEP_CPU_ONLY=1 implies); the
#                          small _protocol module is always built
#   MEP_REQUIRE_EXTENSION=1  fail if the extension cannot be built (CI sets it)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MEP_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
if [ "${MEP_CPU_ONLY:-0}" = "1" ]; then export MEP_SKIP_CUDA=1; fi
_mep_say() { echo "set-up: $*" >&2; }
_mep_fresh=0
if [ ! -x "$VENV/bin/python" ]; then
  _mep_say "creating $VENV (first run: installs torch, megatron-core and the test tools; a few minutes)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  _mep_fresh=1
fi
# dependencies: again only when requirements.txt changed since the last install
_mep_req_sum=$(cksum < "$ROOT/requirements.txt")
if [ "$(cat "$VENV/.mep-requirements" 2>/dev/null)" != "$_mep_req_sum" ]; then
  if [ -n "${MEP_TORCH_INDEX_URL:-}" ]; then
    "$VENV/bin/python" -m pip install -q --index-url "$MEP_TORCH_INDEX_URL" \
      "$(grep -E '^torch([=<>!~ ]|$)' "$ROOT/requirements.txt" | head -1 | sed 's/ *#.*//')"
  fi
  "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements.txt"
  echo "$_mep_req_sum" > "$VENV/.mep-requirements"
fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
# the package itself (a .pth to the source tree), once: setuptools prints a warning box each time
if ! (cd / && "$VENV/bin/python" -c "import importlib.util as u, sys; s = u.find_spec('megatron_ep'); \
sys.exit(0 if s and s.origin and s.origin.startswith(sys.argv[1] + '/') else 1)" "$ROOT/megatron_ep"); then
  MEP_SKIP_CUDA=1 "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" > "$VENV/.mep-install.log" 2>&1 \
    || { cat "$VENV/.mep-install.log" >&2; exit 1; }
fi
# then the compiled modules in place: _protocol always (plain C++, the call protocol both
# backends read), the CUDA extension unless skipped; again only when csrc/ or setup.py changed
# since the last build (or when a module is missing)
_mep_stamp="$VENV/.mep-build.stamp"
if [ ! -e "$_mep_stamp" ] || [ -n "$(find "$ROOT/csrc" "$ROOT/setup.py" -newer "$_mep_stamp" -print -quit)" ] \
   || ! ls "$ROOT"/megatron_ep/_protocol*.so > /dev/null 2>&1 \
   || { [ "${MEP_SKIP_CUDA:-0}" != "1" ] && [ "${MEP_REQUIRE_EXTENSION:-0}" = "1" ] && ! ls "$ROOT"/megatron_ep/_C*.so > /dev/null 2>&1; }; then
  if [ "${MEP_SKIP_CUDA:-0}" = "1" ]; then
    _mep_say "compiling megatron_ep's protocol module (the CUDA extension is skipped)"
  else
    _mep_say "compiling megatron_ep's CUDA extension if nvcc is here (sm_90 kernels: Hopper GPUs only; ~2 min on 2 cores; MEP_CPU_ONLY=1 skips it)"
  fi
  (cd "$ROOT" && MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VENV/bin/python" setup.py -q build_ext --inplace) > "$VENV/.mep-build.log" 2>&1 \
    || { tail -40 "$VENV/.mep-build.log" >&2; _mep_say "build failed (full log: $VENV/.mep-build.log)"; exit 1; }
  grep -h "^megatron_ep:" "$VENV/.mep-build.log" >&2 || true  # e.g. "no nvcc; building without the CUDA extension"
  touch "$_mep_stamp"
fi
if [ "$_mep_fresh" = "1" ]; then
  _mep_say "done; to run the README's other commands: source ${VENV#$PWD/}/bin/activate"
fi
export PATH="$VENV/bin:$PATH"
