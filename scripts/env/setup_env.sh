#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment with the project's dependencies
# (requirements.txt) and megatron_ep installed in editable mode, its CUDA extension compiled in
# place when nvcc and a CUDA build of torch are present. Sourced by run_demo.sh and test.sh;
# afterwards `source .venv/bin/activate` puts the environment on the PATH of your shell.
# A second run installs and compiles only what changed (requirements.txt, csrc/, setup.py).
# How long (a fresh 2-core machine): about 15 minutes the first time, most of it pip's
# download and install of ~5.6 GB (its progress is shown), then ~4 minutes of compiling (a line
# per compile step); seconds on later runs.
#   MEGATRON_EP_VENV=path            where the environment lives (default: .venv in the repository)
#   MEGATRON_EP_CPU_ONLY=1           laptops / CPU machines: skip the extension (its kernels run on
#                                    Hopper GPUs only); saves the ~4 min compile and the need for
#                                    nvcc, not the download: PyPI's torch for Linux is the CUDA build
#                                    (~5 GB with its nvidia-* wheels)
#   MEGATRON_EP_TORCH_INDEX_URL=u    install torch from this index first, e.g. PyTorch's CPU-only
#                                    wheels https://download.pytorch.org/whl/cpu (~0.2 GB; untested
#                                    by us: our machines cannot reach it)
#   MEGATRON_EP_SKIP_CUDA=1          skip the CUDA extension build (what MEGATRON_EP_CPU_ONLY=1
#                                    implies); the small _protocol module is always built
#   MEGATRON_EP_REQUIRE_EXTENSION=1  fail if the extension cannot be built (CI sets it)
# Each was read as MEP_* before; the old name still works, with a notice.
# Switches take 1 / true / yes / on and 0 / false / no / off (or unset), as everywhere in
# megatron_ep: megatron_ep/core/envs.py parses them; another value is refused in one line.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# the set-up's own two names, read as megatron_ep/core/envs.py reads the others (RENAMED)
for _mep_name in VENV TORCH_INDEX_URL; do
  _mep_new=MEGATRON_EP_$_mep_name _mep_old=MEP_$_mep_name
  if [ -z "${!_mep_new+x}" ] && [ -n "${!_mep_old+x}" ]; then
    echo "megatron_ep: $_mep_old is now $_mep_new; the old name still works" >&2
    export "$_mep_new=${!_mep_old}"
  fi
done
VENV=${MEGATRON_EP_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
_mep_say() { echo "set-up: $*" >&2; }
_mep_since() { local s=$((SECONDS - $1)); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
_mep_start=$SECONDS
# the switches, through the library's own parser (one rule; a bad value: one line, status 2),
# run by PYTHON, else the environment's python once it exists, else python3
_mep_parse_py=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x "$VENV/bin/python" ]; then _mep_parse_py=$VENV/bin/python; fi
_mep_flags=$("$_mep_parse_py" "$ROOT/megatron_ep/core/envs.py" --prog set-up flag MEGATRON_EP_CPU_ONLY MEGATRON_EP_SKIP_CUDA MEGATRON_EP_REQUIRE_EXTENSION) \
  || exit 2
{ read -r _mep_cpu_only; read -r _mep_skip_cuda; read -r _mep_require; } <<< "$_mep_flags"
if [ "$_mep_cpu_only" = "1" ]; then _mep_skip_cuda=1; export MEGATRON_EP_SKIP_CUDA=1; fi
_mep_fresh=0
if [ ! -x "$VENV/bin/python" ]; then
  _mep_say "creating $VENV (first run: about 15 minutes on a 2-core machine in all; the next steps say what they do)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  _mep_fresh=1
fi
# dependencies: again only when requirements.txt changed since the last install
_mep_req_sum=$(cksum < "$ROOT/requirements.txt")
if [ "$(cat "$VENV/.mep-requirements" 2>/dev/null)" != "$_mep_req_sum" ]; then
  _mep_t=$SECONDS
  _mep_say "installing requirements.txt: about 5.6 GB the first time (torch with its CUDA libraries), usually" \
           "the longest step (about 10 minutes on a typical connection); pip's progress follows"
  if [ -n "${MEGATRON_EP_TORCH_INDEX_URL:-}" ]; then
    "$VENV/bin/python" -m pip install --index-url "$MEGATRON_EP_TORCH_INDEX_URL" \
      "$(grep -E '^torch([=<>!~ ]|$)' "$ROOT/requirements.txt" | head -1 | sed 's/ *#.*//')"
  fi
  "$VENV/bin/python" -m pip install -r "$ROOT/requirements.txt"
  echo "$_mep_req_sum" > "$VENV/.mep-requirements"
  _mep_say "requirements installed in $(_mep_since $_mep_t)"
fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
# the package itself (a .pth to the source tree), once: setuptools prints a warning box each time
if ! (cd / && "$VENV/bin/python" -c "import importlib.util as u, sys; s = u.find_spec('megatron_ep'); \
sys.exit(0 if s and s.origin and s.origin.startswith(sys.argv[1] + '/') else 1)" "$ROOT/megatron_ep"); then
  _mep_say "installing megatron_ep in editable mode (seconds)"
  MEGATRON_EP_SKIP_CUDA=1 "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" > "$VENV/.mep-install.log" 2>&1 \
    || { cat "$VENV/.mep-install.log" >&2; exit 1; }
fi
# The build's output goes to its log; each compile step ninja finishes (its "[k/N] command"
# lines, k of N steps of one extension) and setup.py's own notes ("megatron_ep: ...") are said as
# one line with the time so far.
_mep_progress() {
  local line what t0=$SECONDS
  while IFS= read -r line; do
    printf '%s\n' "$line" >> "$VENV/.mep-build.log"
    case $line in
      "["[0-9]*/[0-9]*"]"*)
        what=$(grep -o '[^ /]*\.\(cu\|cpp\)\b' <<< "$line" | head -1 || true)
        _mep_say "compiled ${line%%]*}] ${what:-(device link)} ($(_mep_since "$t0") so far)" ;;
      megatron_ep:*) echo "$line" >&2 ;;  # e.g. "no nvcc; building without the CUDA extension"
    esac
  done
}
# then the compiled modules in place: _protocol always (plain C++, the call protocol both
# backends read), the CUDA extension unless skipped; again only when csrc/ or setup.py changed
# since the last build (or when a module is missing)
_mep_stamp="$VENV/.mep-build.stamp"
if [ ! -e "$_mep_stamp" ] || [ -n "$(find "$ROOT/csrc" "$ROOT/setup.py" -newer "$_mep_stamp" -print -quit)" ] \
   || ! ls "$ROOT"/megatron_ep/_protocol*.so > /dev/null 2>&1 \
   || { [ "$_mep_skip_cuda" != "1" ] && [ "$_mep_require" = "1" ] && ! ls "$ROOT"/megatron_ep/_C*.so > /dev/null 2>&1; }; then
  _mep_t=$SECONDS
  if [ "$_mep_skip_cuda" = "1" ]; then
    _mep_say "compiling megatron_ep's protocol module (seconds; the CUDA extension is skipped)"
  else
    _mep_say "compiling megatron_ep's CUDA extension if nvcc is here (sm_90 kernels: Hopper GPUs only; about 4 minutes" \
             "on 2 cores, a line per step; MEGATRON_EP_CPU_ONLY=1 skips it)"
  fi
  : > "$VENV/.mep-build.log"
  if ! (cd "$ROOT" && MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VENV/bin/python" setup.py -q build_ext --inplace) 2>&1 | _mep_progress; then
    tail -40 "$VENV/.mep-build.log" >&2; _mep_say "build failed (full log: $VENV/.mep-build.log)"; exit 1
  fi
  _mep_say "compiled in $(_mep_since $_mep_t)"
  touch "$_mep_stamp"
fi
if [ "$_mep_fresh" = "1" ]; then
  _mep_say "done in $(_mep_since $_mep_start); to run the README's other commands: source ${VENV#$PWD/}/bin/activate"
fi
export PATH="$VENV/bin:$PATH"
